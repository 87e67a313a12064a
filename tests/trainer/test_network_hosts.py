"""Several machines, emulated on this one: network namespaces, each with a network stack, a host
name and an ``/etc/hosts`` of its own (its own name on 127.0.1.1, as Debian and Ubuntu write
it), joined by virtual Ethernet links through a bridge. gloo's default device binds to where
the host name resolves, here a loopback address that no other host can reach; these tests
fail that way without :mod:`gspo.rollout.gloo_net`. They share the file system, the CPUs and
the kernel: what they check is the network path, not real machines' speed.

The network tests need root (``ip netns``, ``unshare``) and are in the slow lane; the helpers'
own tests are fast.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proc_session import run_session
from safetensors.torch import load_file

from gspo.rollout import gloo_net

REPO = Path(__file__).resolve().parents[2]
COMMON = ["model=tiny:llama", "run_name=r", "progress=false", "tensorboard=false",
          "num_threads=1", "rollout.max_new_tokens=5", "rollout.prompts_per_step=4",
          "rollout.group_size=4", "rollout.temperature=1.0", "objective.num_minibatches=2",
          "task.eval_size=0", "eval_before=false", "optim.lr=1e-4", "save_every=1",
          "logging.samples_every=0", "objective.scale_rewards=batch",
          "reward.functions=[host_reward:char_codes]", "rollout.async_steps=2", "steps=3"]
REWARD = """
def char_codes(prompts, completions, **_):  # differs within almost every group
    return [float(sum(map(ord, c)) % 97) for c in completions]
"""
HOSTS = ("h0", "h1", "h2")  # h0, h1: trainer machines; h2: the inference machine
# above 127.x: gloo's two ends decide which one listens by comparing addresses, so with
# addresses below 127.0.1.1 a rank bound to loopback would connect out and go unnoticed
ADDRESS = {name: f"192.168.{os.getpid() % 250}.{i + 1}" for i, name in enumerate(HOSTS)}
# the same hosts with IPv6 addresses only (unique local, fd00::/8): no IPv4 route anywhere
ADDRESS6 = {name: f"fd{os.getpid() % 250:02x}::{i + 1}" for i, name in enumerate(HOSTS)}


def test_route_source_and_interface_on_loopback():
    assert gloo_net.route_source("127.0.0.1") == "127.0.0.1"
    assert gloo_net.route_source("no-such-host.invalid") is None
    if sys.platform == "linux":
        assert gloo_net.interface_of("127.0.0.1") == "lo"
    assert gloo_net.interface_of("192.0.2.77") is None  # TEST-NET-1: on no interface here


def test_interface_towards_master_only_when_the_world_spans_machines(monkeypatch):
    """One machine, no master, or an interface the user named: gloo's default stands (None).
    Across machines: the interface on the route to the master; on the master's own machine,
    whose name resolves to loopback there, the interface of its outward address."""
    f = gloo_net.interface_towards_master
    two = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}
    assert f({"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}) is None
    assert f(two) is None
    routes = {"192.0.2.1": "192.0.2.5", "h0": "127.0.0.1", "127.0.0.1": "127.0.0.1"}
    monkeypatch.setattr(gloo_net, "route_source", routes.get)
    monkeypatch.setattr(gloo_net, "interface_addresses",
                        lambda: {"lo": "127.0.0.1", "eth7": "192.0.2.5"})
    assert f({"MASTER_ADDR": "192.0.2.1", **two}) == "eth7"
    assert f({"MASTER_ADDR": "h0", **two}) == "eth7"  # this machine is the master
    assert f({"MASTER_ADDR": "192.0.2.1", "WORLD_SIZE": "2"}) is None  # one machine
    assert f({"MASTER_ADDR": "192.0.2.1", gloo_net.IFNAME: "eth1", **two}) is None
    assert gloo_net.reachable_source("127.0.0.1") == "127.0.0.1"  # loopback meant as such
    monkeypatch.setattr(gloo_net, "route_source", lambda host: None)  # no default route
    monkeypatch.setattr(gloo_net, "interface_addresses6", lambda: {"eth7": "fd00::5"})
    assert gloo_net.outward_address() == "192.0.2.5"  # the one interface but loopback
    monkeypatch.setenv(gloo_net.IFNAME, "eth1")
    assert gloo_net.device_towards("192.0.2.1") is None  # no such interface: gloo's own


def test_a_named_interface_binds_in_the_family_of_the_route(monkeypatch):
    """With GLOO_SOCKET_IFNAME naming one interface, the link binds to that interface's
    address in the family of the route to the peer (its other one where it has only that);
    a list of interfaces keeps gloo's default device."""
    routes = {"192.0.2.1": "192.0.2.5", "fd01::1": "fd00::5", "h0": "127.0.1.1"}
    monkeypatch.setattr(gloo_net, "route_source", routes.get)
    monkeypatch.setattr(gloo_net, "interface_addresses",
                        lambda: {"lo": "127.0.0.1", "eth7": "192.0.2.5", "eth8": "10.0.0.8"})
    monkeypatch.setattr(gloo_net, "interface_addresses6", lambda: {"eth7": "fd00::5"})
    monkeypatch.setenv(gloo_net.IFNAME, "eth7")
    assert gloo_net.bind_source("192.0.2.1") == "192.0.2.5"
    assert gloo_net.bind_source("fd01::1") == "fd00::5"
    assert gloo_net.bind_source("h0") == "192.0.2.5"  # own name: loopback, IPv4 first
    assert gloo_net.bind_source("no-route") == "192.0.2.5"
    monkeypatch.setenv(gloo_net.IFNAME, "eth8")
    assert gloo_net.bind_source("fd01::1") == "10.0.0.8"  # the only address it has
    monkeypatch.setenv(gloo_net.IFNAME, "eth7,eth8")
    assert gloo_net.bind_source("192.0.2.1") is None


def test_outward_address_on_a_host_without_ipv4(monkeypatch):
    """No IPv4 default route and no IPv4 address but loopback: the IPv6 default route's
    source, else the one interface's global IPv6 address (link-local ones are not listed)."""
    routes = {"2001:db8::1": "fd00::5"}
    monkeypatch.setattr(gloo_net, "route_source", routes.get)
    monkeypatch.setattr(gloo_net, "interface_addresses", lambda: {"lo": "127.0.0.1"})
    monkeypatch.setattr(gloo_net, "interface_addresses6", lambda: {"eth7": "fd00::5"})
    assert gloo_net.outward_address() == "fd00::5"
    routes.clear()  # no default route at all: the one interface
    assert gloo_net.outward_address() == "fd00::5"
    monkeypatch.setattr(gloo_net, "interface_addresses6",
                        lambda: {"eth7": "fd00::5", "eth8": "fd01::5"})
    assert gloo_net.outward_address() is None  # two interfaces: not settled here
    monkeypatch.setattr(gloo_net, "interface_addresses", lambda: {"eth7": "192.0.2.5"})
    monkeypatch.setattr(gloo_net, "interface_addresses6", lambda: {"eth7": "fd00::5"})
    assert gloo_net.outward_address() == "192.0.2.5"  # one interface, both: its IPv4 one


def test_interface_addresses6_reads_global_addresses_only():
    if not Path("/proc/net/if_inet6").exists():
        pytest.skip("no /proc/net/if_inet6 (not Linux, or IPv6 off)")
    got = gloo_net.interface_addresses6()
    assert "lo" not in got  # ::1 is scope host
    for name, address in got.items():
        ip = ipaddress.ip_address(address)
        assert ip.version == 6 and not ip.is_link_local and not ip.is_loopback, (name, ip)
        assert gloo_net.interface_of(address) == name


class Hosts:
    """The namespaces ``<prefix>h0`` … and the bridge's ``<prefix>sw``. ``family``: each host
    has an IPv4 address (``ADDRESS``, "ipv4"), an IPv6 one only (``ADDRESS6``, "ipv6"), or
    both, with the hosts' names resolving to their IPv6 addresses ("dual")."""

    def __init__(self, prefix: str, family: str = "ipv4") -> None:
        self.prefix, self.family = prefix, family
        self.names = ADDRESS if family == "ipv4" else ADDRESS6  # what the names resolve to

    def ns(self, name: str) -> str:
        return self.prefix + name

    def up(self) -> None:
        sw = self.ns("sw")
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, name in enumerate(HOSTS):
            ns, inner, outer = self.ns(name), f"{self.prefix}e{i}", f"{self.prefix}p{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "netns", sw)
            _ip("-n", sw, "link", "set", outer, "master", "br0")
            _ip("-n", sw, "link", "set", outer, "up")
            if self.family != "ipv6":
                _ip("-n", ns, "addr", "add", f"{ADDRESS[name]}/24", "dev", inner)
            if self.family != "ipv4":  # nodad: usable at once
                _ip("-n", ns, "addr", "add", f"{ADDRESS6[name]}/64", "dev", inner, "nodad")
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns  # `ip netns exec` mounts it over /etc/hosts
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(
                f"127.0.0.1 localhost\n127.0.1.1 {name}\n"
                + "".join(f"{a} {n}\n" for n, a in self.names.items() if n != name))

    def down(self) -> None:
        for name in (*HOSTS, "sw"):
            subprocess.run(["ip", "netns", "del", self.ns(name)], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / self.ns(name), ignore_errors=True)

    def start(self, host: str, argv: list[str], env: dict[str, str], log: Path
              ) -> subprocess.Popen:
        """``argv`` on ``host``, under its own host name."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), "unshare", "--uts", "sh", "-c",
             f'hostname {host} && exec "$@"', "sh", *argv],
            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True)  # torchrun's workers too go with os.killpg


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def _hosts(prefix: str, family: str = "ipv4"):
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("network namespaces need root on Linux")
    if not (shutil.which("ip") and shutil.which("unshare")):
        pytest.skip("needs `ip` (iproute2) and `unshare` (util-linux)")
    h = Hosts(f"{prefix}{os.getpid() % 100000}", family)
    try:
        h.up()
    except subprocess.CalledProcessError as e:
        h.down()
        pytest.skip(f"cannot make network namespaces here: {e.stderr.strip()}")
    try:
        yield h
    finally:
        h.down()


@pytest.fixture(scope="module")
def hosts():
    with _hosts("g") as h:
        yield h


@pytest.fixture(scope="module")
def hosts6():
    with _hosts("v", "ipv6") as h:
        yield h


@pytest.fixture(scope="module")
def hosts_dual():
    with _hosts("d", "dual") as h:
        yield h


def _env(out: Path) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_reward.py").write_text(REWARD)
    drop = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", gloo_net.IFNAME)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "PYTHONPATH": os.pathsep.join([str(REPO), str(out)])}


def _wait(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 300) -> None:
    """Until every process has exited 0; fails as soon as one exits otherwise (the others
    may be waiting on it) or at ``timeout``."""
    end = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            for p, log in zip(procs, logs):
                assert p.poll() in (None, 0), f"{log.name}: exit {p.returncode}\n" + \
                    log.read_text()[-3000:]
            assert time.monotonic() < end, f"still running after {timeout:.0f} s"
            time.sleep(0.5)
        for p, log in zip(procs, logs):
            assert p.returncode == 0, f"{log.name}: exit {p.returncode}\n{log.read_text()[-3000:]}"
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _engines(hosts: Hosts, out: Path, env: dict[str, str], addresses: list[str]
             ) -> tuple[list[subprocess.Popen], list[Path]]:
    """One `gspo engine` on the inference machine h2 for each address."""
    logs = [out / f"engine{i}.log" for i in range(len(addresses))]
    return ([hosts.start("h2", [sys.executable, "-m", "gspo", "engine", a, "--timeout", "120"],
                         env, log) for a, log in zip(addresses, logs)], logs)


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in open(run / "metrics.jsonl") if "train/loss" in x]


def _same_run(a: Path, b: Path, step: int = 3) -> None:
    wa, wb = (load_file(r / f"checkpoints/step_{step:06d}/model.safetensors") for r in (a, b))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) == 0.0
    assert [r["train/loss"] for r in _rows(a)] == [r["train/loss"] for r in _rows(b)]
    assert [r["async/staleness_max"] for r in _rows(b)] == [0, 1, 2]


def _local(out: Path, world: int) -> Path:
    """The same run on this machine, its engines spawned here: 1 process or torchrun."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node", str(world)] if world > 1 else [sys.executable])
    proc = run_session([*launcher, "-m", "gspo", "train", *COMMON, f"output_dir={out}"],
                       env=_env(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "r"


@pytest.mark.slow
@pytest.mark.parametrize("where", ["tcp", "file", "tcp-ipv6", "tcp-dual"])
def test_an_engine_on_another_host_gives_the_local_engines_run(where, request, tmp_path):
    """The trainer on h0, its `gspo engine` on h2 (k = 2): the run of the engine spawned on
    the trainer's machine, bit for bit. They meet at the trainer's TCP store, or at a file
    store on the file system the hosts share; at the TCP store also on hosts with IPv6 only,
    and on hosts with both where h0's name resolves to IPv6 on h2 (the trainer's outward
    address is its IPv4 one). Each end must bind gloo to an address the other reaches: not
    its host name's loopback one, not an IPv4 one where there is no IPv4 route, and in the
    same address family as the other end."""
    fixture = {"tcp-ipv6": "hosts6", "tcp-dual": "hosts_dual"}.get(where, "hosts")
    hosts = request.getfixturevalue(fixture)
    out = tmp_path / "hosts"
    env = _env(out)
    address = f"file://{tmp_path}/store" if where == "file" else "tcp://h0:29611"
    engines, logs = _engines(hosts, out, env, [address])
    trainer_log = out / "trainer.log"
    trainer = hosts.start("h0", [sys.executable, "-m", "gspo", "train", *COMMON,
                                 f"output_dir={out}", f"rollout.async_address={address}"],
                          env, trainer_log)
    _wait([trainer, *engines], [trainer_log, *logs])
    _same_run(_local(tmp_path / "local", 1), out / "r")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["ipv4", "ipv6", "dual"])
def test_torchrun_across_hosts_with_an_engine_on_a_third(family, request, tmp_path):
    """A 2-rank trainer with one rank on each of h0 and h1 (torchrun, static ranks, master h0),
    each rank's `gspo engine` on h2: the one-machine 2-rank run with spawned engines, bit for
    bit. Both the trainers' gloo world and each rank's link to its engine cross hosts: on
    IPv4 hosts, on hosts with IPv6 only, and on hosts with both whose names resolve to IPv6."""
    hosts = request.getfixturevalue({"ipv4": "hosts", "ipv6": "hosts6",
                                     "dual": "hosts_dual"}[family])
    out = tmp_path / "hosts"
    env = _env(out)
    addresses = ["tcp://h0:29621", "tcp://h1:29622"]
    engines, logs = _engines(hosts, out, env, addresses)
    trainer_logs = [out / f"node{i}.log" for i in range(2)]
    trainers = [hosts.start(h, [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(i),
        "--nproc_per_node", "1", "--master_addr", "h0", "--master_port", "29620", "-m", "gspo",
        "train", *COMMON, f"output_dir={out}", f"rollout.async_address={','.join(addresses)}"],
        env, log) for i, (h, log) in enumerate(zip(("h0", "h1"), trainer_logs))]
    _wait([*trainers, *engines], [*trainer_logs, *logs])
    _same_run(_local(tmp_path / "local", 2), out / "r")
