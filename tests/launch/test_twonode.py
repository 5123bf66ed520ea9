"""Two "nodes" on one machine, each a network namespace with its own address (ip netns + a
veth pair: node A 10.R.S.1, node B 10.R.S.2), so the inter-node path really runs:

- mpirun with a hostfile naming both addresses starts node A's ranks itself and node B's
  through an rsh agent that enters B's namespace (`--mca plm_rsh_agent`, a stand-in for ssh);
  Open MPI's traffic goes over the veth (btl tcp, `*_if_include` the veth subnet; shared memory
  would cross the "nodes"). The CPU demo with 2 ranks on each node gives exactly the per-step
  losses and the export of the one-node run (same layout: same order of every sum);
- the torchrun-style launch: ranks 0-1 in A, 2-3 in B, MASTER_ADDR = A's veth address (not
  localhost): the ranks in B reach rank 0's c10d store on the other "host";
- a missing node: the hostfile names a third address nobody answers on: mpirun fails within
  seconds and nothing is left.
Needs root and `ip` (iproute2); skipped with the reason otherwise.
"""
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from common import (BIN, DEMO, SOURCE, assets, clean_env, demo_overrides, export_digest, free_port,  # noqa: F401
                    reference, run, step_losses, wait_gone)


def sh(*cmd):
    subprocess.run(list(cmd), check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (ip netns)")
    tag = uuid.uuid4().hex[:5]
    subnet = f"10.{100 + os.getpid() % 100}.{int(tag[:2], 16)}"
    a, b = f"dfl{tag}a", f"dfl{tag}b"
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b")
        sh("ip", "link", "set", f"v{tag}a", "netns", a)
        sh("ip", "link", "set", f"v{tag}b", "netns", b)
        for ns, dev, ip in ((a, f"v{tag}a", f"{subnet}.1"), (b, f"v{tag}b", f"{subnet}.2")):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"network namespaces unavailable: {e.stderr.strip()}")
    d = tmp_path_factory.mktemp("nodes")
    # the rsh agent: `agent [ssh options] HOST COMMAND...` -> run COMMAND in HOST's namespace
    agent = d / "netns-rsh"
    agent.write_text(f"""#!/bin/sh
# stand-in for ssh between the test's network namespaces (tests/launch/test_twonode.py)
while [ $# -gt 0 ]; do case "$1" in -o|-p|-l|-i) shift 2 ;; -*) shift ;; *) break ;; esac; done
host=$1; shift
case "$host" in
  {subnet}.1) ns={a} ;;
  {subnet}.2) ns={b} ;;
  *) echo "netns-rsh: ssh: connect to host $host: No route to host" >&2; exit 255 ;;
esac
# its own host name too (a UTS namespace): Open MPI tells nodes apart by name
exec ip netns exec "$ns" unshare --uts sh -c "hostname $ns; $*"
""")
    agent.chmod(0o755)
    hostfile = d / "hosts"
    hostfile.write_text(f"{subnet}.1 slots=2\n{subnet}.2 slots=2\n")
    yield {"a": a, "b": b, "ip_a": f"{subnet}.1", "ip_b": f"{subnet}.2", "subnet": f"{subnet}.0/24",
           "agent": str(agent), "hostfile": str(hostfile), "dir": d}
    for ns in (a, b):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def mpirun_two_nodes(nodes, hostfile, *args, timeout=300):
    env = clean_env(OMPI_MCA_btl="self,tcp", OMPI_MCA_btl_tcp_if_include=nodes["subnet"],
                    OMPI_MCA_oob_tcp_if_include=nodes["subnet"], OMPI_MCA_plm_rsh_agent=nodes["agent"])
    cmd = ["ip", "netns", "exec", nodes["a"], "mpirun", "-np", 4, "--hostfile", hostfile, BIN, *args]
    return run(cmd, env=env, timeout=timeout, cwd=SOURCE)


def test_mpirun_hostfile_two_nodes_gives_the_one_node_losses(nodes, assets, reference, tmp_path):
    run_dir = tmp_path / "run"
    p = mpirun_two_nodes(nodes, nodes["hostfile"], "--config", DEMO, *demo_overrides(assets, str(run_dir)),
                         "log.level=debug", "log.console_rank=-1")
    assert p.returncode == 0, p.all[-4000:]
    # every rank knew its node: local ranks 0-1 on each of the two "nodes" (MPI_COMM_TYPE_SHARED)
    ids = re.findall(r"identity: rank (\d)/4 \(local (\d)/(\d), mpi", p.all)
    assert sorted(ids) == [("0", "0", "2"), ("1", "1", "2"), ("2", "0", "2"), ("3", "1", "2")], p.all[-3000:]
    assert step_losses(run_dir) == reference[0]
    assert export_digest(run_dir) == reference[1]


def test_torchrun_style_store_on_the_other_node(nodes):
    port = free_port()
    procs = []
    for r in range(4):
        ns = nodes["a"] if r < 2 else nodes["b"]
        env = clean_env(mpi=False, RANK=r, LOCAL_RANK=r % 2, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2,
                        MASTER_ADDR=nodes["ip_a"], MASTER_PORT=port)
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, str(BIN), "--whoami", "comm.startup_timeout_s=30"],
                                      env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    text = "".join(p.communicate(timeout=90)[0] for p in procs)
    assert all(p.returncode == 0 for p in procs), text
    ids = re.findall(r"identity: rank (\d)/4 \(local (\d)/2, torchrun", text)
    assert sorted(ids) == [("0", "0"), ("1", "1"), ("2", "0"), ("3", "1")], text
    assert len(re.findall(r"rendezvous: \d local \d/2 torchrun", text)) == 4, text


def test_mpirun_unreachable_node_fails_fast(nodes, tmp_path):
    hosts = tmp_path / "hosts"
    subnet = nodes["ip_a"].rsplit(".", 1)[0]
    hosts.write_text(f"{nodes['ip_a']} slots=2\n{subnet}.9 slots=2\n")
    marker = f"unreach{uuid.uuid4().hex[:6]}"
    p = mpirun_two_nodes(nodes, str(hosts), "--whoami", f"run.name={marker}", timeout=120)
    assert p.returncode != 0, p.all
    assert p.elapsed < 60, p.elapsed
    assert "No route to host" in p.all or "unable to reliably start" in p.all, p.all[-2000:]
    assert wait_gone(marker) == []
