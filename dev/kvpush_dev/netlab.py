"""A multi-host lab on one machine: network namespaces as hosts, one bridge, real TCP between them.

Why: every other test runs P and D on loopback in one namespace, where UCX can move bytes
through shared memory. Here each "host" is a namespace ``kvp-<lab>-<host>`` with one veth
(``eth0``) whose other end sits on a bridge inside a switch namespace ``kvp-<lab>-sw``.
Addresses come from the benchmarking range 198.18.0.0/15 and exist only inside those
namespaces: the machine's own namespace gets no link, no address, no route, no rule.

Faults are injected where a real network would have them: nftables loss / partition rules
and tbf caps inside a host's namespace, link state on the switch side of its veth, a
user-space delay relay on a control path, SIGKILL of everything in a host's namespace.

``up()`` and ``down()`` are idempotent (``up()`` first removes leftovers of a lab of the same
name); ``down()`` kills every process in the lab's namespaces, removes the namespaces (links,
rules and qdiscs go with them) and unlinks /dev/shm files those processes left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvpush_dev.vllm_env import child_setup

NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000
SUBNET = "198.18.0"  # inside 198.18.0.0/15 (RFC 2544 benchmarking): never routed anywhere
PREFIX_LEN = 24
NFT_TABLE = "kvplab"
# /dev/shm files a killed engine leaves (torch's KV export, vLLM's queues and TP communicator): the only
# ones cleanup removes (never e.g. multiprocessing's sem.* of a process outside the lab).
ORPHAN_PREFIXES = ("torch_", "vllm_", "psm_")  # psm_: vLLM's shared-memory message queues
T = TypeVar("T")


class LabUnavailable(RuntimeError):
    """This machine cannot run the lab (not root, no ``ip netns``); the message says why."""


def unavailable_reason(need_nft: bool = False) -> str:
    """Why the lab cannot run here, or "" when it can (tests skip with this message)."""
    if os.geteuid() != 0:
        return "the multi-host lab needs root (network namespaces, veth, nftables)"
    if shutil.which("ip") is None:
        return "the multi-host lab needs iproute2 (`ip netns`)"
    if need_nft and shutil.which("nft") is None:
        return "this fault needs nftables (`apt-get install nftables`)"
    probe = f"kvp-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


# --------------------------------------------------------------------------- namespaces

_libc = ctypes.CDLL(None, use_errno=True)


def enter_netns(ns: str) -> None:
    """Move the calling thread into network namespace ``ns`` (sockets made after it live there).

    Python 3.11 has no os.setns; the network namespace is per thread, so a thread can talk
    from inside a host while the rest of the process stays where it was."""
    fd = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _sh(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, input=input)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip() or r.stdout.strip()}")
    return r


def netns_pids(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns`` (never this process itself)."""
    r = _sh("ip", "netns", "pids", ns, check=False)
    pids = [int(x) for x in r.stdout.split() if x.isdigit()]
    return [p for p in pids if p != os.getpid()]


def _shm_mapped_by(pids: Iterable[int]) -> set[str]:
    out: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if " /dev/shm/" in line and not line.rstrip().endswith("(deleted)"):
                        name = line.split(" /dev/shm/", 1)[1].strip()
                        if "/" not in name:
                            out.add(f"/dev/shm/{name}")
    return out


def sweep_stale(prefix: str = "kvp-t") -> list[str]:
    """Remove labs named ``<prefix><pid>-*`` whose creating process ``pid`` is gone (a test
    run that was SIGKILLed); returns the namespaces removed. Labs of live runs stay."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for ns in sorted(os.listdir(NETNS_DIR)):
            rest = ns[len(prefix):] if ns.startswith(prefix) else ""
            pid = rest.split("-", 1)[0]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            pids = netns_pids(ns)
            Lab._kill(pids)
            _sh("ip", "netns", "del", ns, check=False)
            out.append(ns)
    return out


def _all_mapped_shm() -> set[str]:
    return _shm_mapped_by(int(p) for p in os.listdir("/proc") if p.isdigit())


@dataclass(frozen=True)
class Host:
    name: str
    ns: str
    addr: str
    sw_if: str  # its veth end on the bridge (inside the switch namespace)
    ifname: str = "eth0"  # its veth end inside its own namespace


@dataclass
class Lab:
    """Hosts as network namespaces on one bridge; see the module docstring."""

    hosts: Sequence[str] = ("p0", "d0")
    name: str = "lab"
    subnet: str = SUBNET
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _by_name: dict[str, Host] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if len(self.hosts) > 200:
            raise ValueError("at most 200 hosts")
        for i, h in enumerate(self.hosts):
            if not h.isalnum() or len(h) > 12:
                raise ValueError(f"host name {h!r}: letters and digits, at most 12")
            self._by_name[h] = Host(h, f"kvp-{self.name}-{h}", f"{self.subnet}.{10 + i}", f"s-{h}")

    # ---------------------------------------------------------------- topology
    @property
    def switch_ns(self) -> str:
        return f"kvp-{self.name}-sw"

    def host(self, name: str) -> Host:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no host {name!r} in lab {self.name!r} (hosts: {list(self._by_name)})") from None

    def ns(self, name: str) -> str:
        return self.host(name).ns

    def addr(self, name: str) -> str:
        return self.host(name).addr

    def namespaces(self) -> list[str]:
        return [self.switch_ns, *(h.ns for h in self._by_name.values())]

    def up(self) -> Lab:
        """Create the switch, the hosts and their links (after removing any leftovers)."""
        reason = unavailable_reason()
        if reason:
            raise LabUnavailable(reason)
        self.down()
        sw = self.switch_ns
        try:
            _sh("ip", "netns", "add", sw)
            _sh("ip", "-n", sw, "link", "set", "lo", "up")
            _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", sw, "link", "set", "br0", "up")
            for h in self._by_name.values():
                _sh("ip", "netns", "add", h.ns)
                _sh("ip", "-n", h.ns, "link", "set", "lo", "up")
                # Made inside the switch namespace with its peer born in the host's: no link
                # ever appears in the machine's own namespace, even if we fail half-way.
                _sh("ip", "-n", sw, "link", "add", h.sw_if, "type", "veth", "peer", "name", h.ifname,
                    "netns", h.ns)
                _sh("ip", "-n", sw, "link", "set", h.sw_if, "master", "br0")
                _sh("ip", "-n", sw, "link", "set", h.sw_if, "up")
                _sh("ip", "-n", h.ns, "addr", "add", f"{h.addr}/{PREFIX_LEN}", "dev", h.ifname)
                _sh("ip", "-n", h.ns, "link", "set", h.ifname, "up")
        except Exception:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill every process in the lab's namespaces, remove the namespaces and the /dev/shm
        files those processes left; safe to call any number of times."""
        present = [ns for ns in self.namespaces() if os.path.exists(os.path.join(NETNS_DIR, ns))]
        pids = [p for ns in present for p in netns_pids(ns)]
        left = _shm_mapped_by(pids)
        for p in self.procs:
            if p.poll() is None:
                pids.append(p.pid)
        self._kill(pids)
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.wait(5)
        self.procs.clear()
        for ns in present:
            _sh("ip", "netns", "del", ns, check=False)
        self.unlink_orphans(left)

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    @staticmethod
    def _kill(pids: list[int], grace: float = 5.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            end = time.monotonic() + grace
            while any(_alive(p) for p in pids) and time.monotonic() < end:
                time.sleep(0.05)
            if not any(_alive(p) for p in pids):
                return

    # ---------------------------------------------------------------- running things
    def popen(self, host: str, argv: list[str], log: Path, env: dict[str, str] | None = None,
              cpus: set[int] | None = None, nice: int = 0) -> subprocess.Popen[bytes]:
        """``argv`` inside ``host``'s namespace, in its own process group, output to ``log``;
        ``nice`` is added to its niceness (inherited by its children and threads)."""
        ns = self.ns(host)
        setup = child_setup(cpus, nice)

        def pre() -> None:
            enter_netns(ns)
            if setup is not None:
                setup()

        proc = subprocess.Popen(argv, stdout=open(log, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env=env or dict(os.environ), preexec_fn=pre)
        self.procs.append(proc)
        return proc

    def exec(self, host: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A short command (nft, tc, ip) inside ``host``'s namespace."""
        return _sh("ip", "netns", "exec", self.ns(host), *argv, check=check)

    def call(self, host: str, fn: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """``fn(*args)`` on a thread inside ``host``'s namespace (an HTTP client, a health check)."""
        box: dict[str, Any] = {}

        def body() -> None:
            try:
                enter_netns(self.ns(host))
                box["v"] = fn(*args)
            except BaseException as exc:  # handed to the caller
                box["e"] = exc

        t = threading.Thread(target=body, daemon=True, name=f"in-{host}")
        t.start()
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} in {host} did not return in {timeout}s")
        if "e" in box:
            raise box["e"]
        return box["v"]  # type: ignore[no-any-return]

    def kill_host(self, host: str) -> list[int]:
        """SIGKILL every process in ``host``'s namespace (a machine that died); returns them."""
        pids = netns_pids(self.ns(host))
        left = _shm_mapped_by(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        end = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.05)
        for p in self.procs:
            if p.pid in pids:
                with contextlib.suppress(Exception):
                    p.wait(5)
        self.unlink_orphans(left)
        return pids

    @staticmethod
    def unlink_orphans(paths: set[str]) -> None:
        """/dev/shm files our killed processes mapped that no live process maps any more."""
        paths = {p for p in paths if os.path.basename(p).startswith(ORPHAN_PREFIXES)}
        if not paths:
            return
        for path in paths - _all_mapped_shm():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # ---------------------------------------------------------------- faults
    def link(self, host: str, up: bool) -> None:
        """``host``'s cable in or out (the switch side of its veth): partition and heal."""
        h = self.host(host)
        _sh("ip", "-n", self.switch_ns, "link", "set", h.sw_if, "up" if up else "down")

    def _nft(self, host: str, script: str) -> None:
        _sh("ip", "netns", "exec", self.ns(host), "nft", "-f", "-", input=script)

    def _nft_reset(self, host: str) -> None:
        self.exec(host, "nft", "delete", "table", "inet", NFT_TABLE, check=False)

    def clear_faults(self, host: str) -> None:
        """Remove ``host``'s nftables rules and its bandwidth cap."""
        self._nft_reset(host)
        self.exec(host, "tc", "qdisc", "del", "dev", self.host(host).ifname, "root", check=False)

    def loss(self, host: str, percent: int, peer: str | None = None) -> None:
        """Drop ``percent`` % of ``host``'s packets at random, both directions (nftables
        ``numgen random``), optionally only those to and from ``peer``."""
        if not 0 <= percent <= 100:
            raise ValueError("percent must be in 0..100")
        self._rules(host, f"numgen random mod 100 < {percent} " if percent < 100 else "", peer)

    def partition(self, host: str, peer: str) -> None:
        """Drop everything between ``host`` and ``peer`` (others still reach both)."""
        self._rules(host, "", peer)

    def _rules(self, host: str, match: str, peer: str | None) -> None:
        """Drop ``host``'s packets (to and from ``peer`` only, if given) that ``match``, counting them."""
        self._nft_reset(host)
        src = f"ip saddr {self.addr(peer)} " if peer else ""
        dst = f"ip daddr {self.addr(peer)} " if peer else ""
        self._nft(host, (
            f"table inet {NFT_TABLE} {{\n"
            f"  chain in {{ type filter hook input priority 0; policy accept; "
            f"iifname \"{self.host(host).ifname}\" {src}{match}counter drop; }}\n"
            f"  chain out {{ type filter hook output priority 0; policy accept; "
            f"oifname \"{self.host(host).ifname}\" {dst}{match}counter drop; }}\n"
            f"}}\n"))

    def dropped(self, host: str) -> int:
        """Packets ``host``'s loss or partition rules have dropped so far, both directions (0
        with no rules): a fault test's proof that its fault hit traffic, read before
        :meth:`clear_faults` removes the rules."""
        out = self.exec(host, "nft", "-j", "list", "table", "inet", NFT_TABLE, check=False)
        if out.returncode:
            return 0
        return sum(x["counter"]["packets"] for e in json.loads(out.stdout)["nftables"] if "rule" in e
                   for x in e["rule"]["expr"] if "counter" in x)

    def cap(self, host: str, rate: str = "1gbit", burst: str = "512kb", latency: str = "50ms") -> None:
        """A token-bucket cap on what ``host`` sends (tbf; this kernel has no netem)."""
        self.exec(host, "tc", "qdisc", "replace", "dev", self.host(host).ifname, "root", "tbf",
                  "rate", rate, "burst", burst, "latency", latency)

    def relay(self, host: str, listen_port: int, to: str, delay_ms: float, log: Path) -> subprocess.Popen[bytes]:
        """A TCP relay inside ``host`` on its address:``listen_port`` forwarding to ``to``
        (``addr:port``) with ``delay_ms`` added to every chunk each way: delay on one path only."""
        import sys

        argv = [sys.executable, "-m", "kvpush_dev.netlab", "relay", "--listen",
                f"{self.addr(host)}:{listen_port}", "--to", to, "--delay-ms", str(delay_ms)]
        proc = self.popen(host, argv, log)
        hp, port = self.addr(host), listen_port
        end = time.monotonic() + 20
        while time.monotonic() < end:
            if proc.poll() is not None:
                raise RuntimeError(f"relay exited with {proc.returncode}; see {log}")
            if self.call(host, _can_connect, hp, port, timeout=5):
                return proc
            time.sleep(0.05)
        raise TimeoutError(f"relay on {hp}:{port} did not listen")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _can_connect(host: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- the delay relay

async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float) -> None:
    """Copy one direction, each chunk delivered ``delay_s`` after it arrived, in order."""
    q: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await q.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.close()

    task = asyncio.create_task(deliver())
    try:
        while True:
            data = await reader.read(1 << 16)
            await q.put((time.monotonic() + delay_s, data))
            if not data:
                break
    except OSError:
        await q.put((0.0, b""))
    with contextlib.suppress(OSError):
        await task


async def _relay(listen: tuple[str, int], to: tuple[str, int], delay_s: float) -> None:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(*to)
        except OSError:
            w.close()
            return
        await asyncio.gather(_pipe(r, uw, delay_s), _pipe(ur, w, delay_s), return_exceptions=True)

    server = await asyncio.start_server(handle, *listen)
    async with server:
        await server.serve_forever()


def _hostport(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpush_dev.netlab relay``: the delay relay (runs inside a lab host)."""
    ap = argparse.ArgumentParser(prog="netlab")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("relay", help="TCP relay adding a fixed delay to each direction")
    r.add_argument("--listen", required=True, help="ADDR:PORT")
    r.add_argument("--to", required=True, help="ADDR:PORT")
    r.add_argument("--delay-ms", type=float, required=True)
    args = ap.parse_args(argv)
    asyncio.run(_relay(_hostport(args.listen), _hostport(args.to), args.delay_ms / 1000))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
