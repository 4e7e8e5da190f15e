"""kvpush router: the OpenAI-API front for P/D serving that sends both legs of a request at once.

``front`` is the HTTP surface shared with the baselines' proxy (kvpush_dev.baseline_proxy),
``app`` the kvpush policy (both legs concurrently, legs built with kvpush.proto.params), ``cli``
the ``kvpush-router`` command.
"""
