"""Harness for launching ops/deploy/cluster-local.yaml with `ray up` in a test, on this machine, over SSH.

What it sets up, and undoes afterwards:
- a throwaway SSH key pair in the test's temporary folder, named as `ssh_private_key` in the rendered cluster
  config, its public half authorized for this user (a marked line in ~/.ssh/authorized_keys);
- sshd on 127.0.0.1:22 if nothing listens there and this is root (started here, ended by its pid);
- a marked block in ~/.bashrc putting this Python environment on the SSH login PATH (Ray runs every
  remote command as `bash --login -c -i 'source ~/.bashrc; ...'`);
- a `ray` shim first on that PATH. `ray stop` (run by the start commands and by `ray down`) ends every
  Ray process on the machine, other test sessions' included; the shim's `stop` ends only the processes
  of this cluster, found by an environment variable that its `ray start` line sets (and every Ray
  process it spawns inherits). Every other `ray` command goes to the real CLI.
The cluster gets a unique name and free ports, so it never meets another Ray instance.

"~" above is the user's home in the password database, where sshd and the login shell look, whatever $HOME says
(a test run may set HOME to a scratch folder).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import yaml

from deployments.ray_env import RAY_DEFAULTS, ray_environment
from tests.support import ROOT

MARK_ENV = "SPECSERVE_TEST_CLUSTER"
# `ray up` clusters run without Ray's token authentication (ops/deploy/cluster-local.yaml says why): the CLI here, the
# node's processes and the dashboard requests of the tests alike.
CLUSTER_RAY_ENV = {**RAY_DEFAULTS, "RAY_AUTH_MODE": "disabled"}
_USER = pwd.getpwuid(os.geteuid())
USER = _USER.pw_name  # who `ray up` logs in as over SSH
HOME = Path(_USER.pw_dir)  # that user's home as sshd sees it ($HOME may point elsewhere)

STOP_SCRIPT = r'''
import os, sys, time, psutil
mark = sys.argv[1]
def ours():
    # Marked processes and their descendants: the raylet starts its DashboardAgent with a fresh
    # environment, so the agent carries no mark (left alone, it outlives the raylet and keeps its ports).
    out = {}
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get("%(env)s") == mark:
                out[p.pid] = p
                for child in p.children(recursive=True):
                    out[child.pid] = child
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    out.pop(os.getpid(), None)
    return list(out.values())
procs = ours()
for p in procs:
    try: p.terminate()
    except psutil.NoSuchProcess: pass
gone, alive = psutil.wait_procs(procs, timeout=3)
for p in alive:
    try: p.kill()
    except psutil.NoSuchProcess: pass
psutil.wait_procs(alive, timeout=5)
print(f"stopped {len(procs)} processes of cluster {mark}")
''' % {"env": MARK_ENV}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def listeners(port: int) -> list[str]:
    """Who listens on `port` (pid, command line), for failure messages."""
    out = []
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            try:
                p = psutil.Process(conn.pid)
                out.append(f"{conn.pid}: {' '.join(p.cmdline())[:200]} {MARK_ENV}={p.environ().get(MARK_ENV)}")
            except (psutil.NoSuchProcess, psutil.AccessDenied, TypeError):
                out.append(str(conn.pid))
    return out


def cluster_processes(mark: str) -> list[int]:
    """Live processes of the cluster: those with its mark in their environment, and their descendants."""
    pids: set[int] = set()
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK_ENV) == mark:
                pids.add(p.pid)
                pids.update(c.pid for c in p.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return sorted(pid for pid in pids if alive(pid))


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def dashboard_metric_names() -> set[str]:
    """Every metric the Grafana dashboard (ops/deploy/grafana/specserve.json) queries, without the _bucket / _sum /
    _count suffix of a histogram."""
    dash = json.loads((ROOT / "ops" / "deploy" / "grafana" / "specserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\bray_[a-z_]+", e)}


# Counters of events a healthy load does not cause (a 429, an out-of-memory preemption): no sample until one happens.
EVENT_ONLY_METRICS = frozenset({"ray_specserve_admission_rejections_total", "ray_specserve_preemptions_total"})
# Counters of pre-speculation, which only a drafter on drafter replicas does (not prompt lookup, not a feature head in
# the target worker: the demo target's default)
PRESPEC_METRICS = frozenset({"ray_specserve_prespec_hits_total", "ray_specserve_prespec_steps_total"})


def missing_tools() -> list[str]:
    return [t for t in ("/usr/sbin/sshd", "ssh", "ssh-keygen", "rsync") if not shutil.which(t) and
            not Path(t).exists()]


class LocalCluster:
    """Renders ops/deploy/cluster-local.yaml for this run and drives `ray up` / `ray down` on it."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.id = uuid.uuid4().hex[:8]
        self.name = f"specserve-test-{self.id}"
        self.gcs_port, self.dashboard_port, self.metrics_port = free_port(), free_port(), free_port()
        self.node_dir = tmp / "node"  # the head's copy of the working tree (file_mounts destination)
        self.bin = tmp / "bin"
        self.key = tmp / "id_ed25519"
        self._sshd: subprocess.Popen | None = None
        self._marker = f"specserve-ray-up-test-{self.id}"
        self._home_files_before = {p for p in ("ray_bootstrap_config.yaml", "ray_bootstrap_key.pem")
                                   if (HOME / p).exists()}
        self.config_path = tmp / "cluster.yaml"
        self.log: list[str] = []
        self.seen: set[int] = set()  # every cluster process noticed (orphans lose the marked parent)

    # -- machine setup ------------------------------------------------------------------------------------
    def setup(self) -> None:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", self._marker, "-f",
                        str(self.key)], check=True)
        ssh_dir = HOME / ".ssh"  # sshd's AuthorizedKeysFile: the real home's, not $HOME's
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        auth = ssh_dir / "authorized_keys"
        with open(auth, "a") as f:
            f.write(self.key.with_suffix(".pub").read_text().strip() + "\n")
        auth.chmod(0o600)

        self.bin.mkdir()
        venv_bin = Path(sys.executable).parent
        real_ray = venv_bin / "ray"
        (self.bin / "stop_cluster.py").write_text(STOP_SCRIPT)
        shim = self.bin / "ray"
        shim.write_text(
            "#!/bin/bash\n"
            f'if [ "$1" = stop ]; then exec {sys.executable} {self.bin / "stop_cluster.py"} {self.id}; fi\n'
            f'exec {real_ray} "$@"\n')
        shim.chmod(0o755)
        ray_vars = " ".join(f"{k}={v}" for k, v in CLUSTER_RAY_ENV.items())
        with open(HOME / ".bashrc", "a") as f:
            f.write(f"# >>> {self._marker} >>>\n"
                    f"export PATH={self.bin}:{venv_bin}:$PATH {ray_vars}\n"
                    f"# <<< {self._marker} <<<\n")

        if not port_open(22):
            assert os.geteuid() == 0, "nothing listens on 127.0.0.1:22, and only root can start sshd"
            subprocess.run(["ssh-keygen", "-A"], check=True, capture_output=True)
            Path("/run/sshd").mkdir(exist_ok=True)
            self._sshd = subprocess.Popen(
                ["/usr/sbin/sshd", "-D", "-e", "-o", "ListenAddress=127.0.0.1", "-o",
                 "PasswordAuthentication=no", "-o", "PermitRootLogin=prohibit-password"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.time() + 10
            while not port_open(22):
                assert time.time() < deadline, "sshd did not start listening on 127.0.0.1:22"
                time.sleep(0.1)
        out = subprocess.run(
            ["ssh", "-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
             "-o", "BatchMode=yes", f"{USER}@127.0.0.1", "bash --login -c -i 'source ~/.bashrc; which ray'"],
            capture_output=True, text=True, timeout=30)
        assert out.stdout.strip().endswith(str(self.bin / "ray")), f"ssh login PATH check failed: {out}"

        self.render()

    def render(self) -> None:
        """Write ops/deploy/cluster-local.yaml with this run's key, paths, ports, marker and name."""
        text = (ROOT / "ops" / "deploy" / "cluster-local.yaml").read_text()
        text = (text.replace("~/specserve-local", str(self.node_dir))
                .replace("$HOME/specserve-local", str(self.node_dir))
                .replace("16379", str(self.gcs_port)).replace("18265", str(self.dashboard_port))
                .replace("18080", str(self.metrics_port))
                .replace("ray start", f"{MARK_ENV}={self.id} ray start")
                # Export metrics every second (default 10 s) so a scrape sees them sooner.
                .replace("ray start --head",
                         "ray start --head --system-config='{\"metrics_report_interval_ms\": 1000}'"))
        config = yaml.safe_load(text)
        config["cluster_name"] = self.name
        config["auth"] = {"ssh_user": USER, "ssh_private_key": str(self.key)}
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def teardown(self) -> None:
        for pid in set(cluster_processes(self.id)) | {p for p in self.seen if alive(p)}:  # what ray down left
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._sshd is not None:
            self._sshd.terminate()
            self._sshd.wait(10)
        auth = HOME / ".ssh" / "authorized_keys"
        if auth.exists():
            auth.write_text("".join(line for line in auth.read_text().splitlines(keepends=True)
                                    if self._marker not in line))
        bashrc = HOME / ".bashrc"
        if bashrc.exists():
            bashrc.write_text(re.sub(rf"# >>> {self._marker} >>>\n.*?# <<< {self._marker} <<<\n", "",
                                     bashrc.read_text(), flags=re.S))
        for p in ("ray_bootstrap_config.yaml", "ray_bootstrap_key.pem"):
            if p not in self._home_files_before:
                (HOME / p).unlink(missing_ok=True)
        for suffix in (".state", ".lock"):
            Path(f"/tmp/cluster-{self.name}{suffix}").unlink(missing_ok=True)

    # -- ray CLI ------------------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        return {**ray_environment(), **CLUSTER_RAY_ENV,
                "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}

    def ray(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        t = time.time()
        out = subprocess.run([str(Path(sys.executable).parent / "ray"), *args], cwd=ROOT, env=self.env(),
                             capture_output=True, text=True, timeout=timeout)
        self.log.append(f"$ ray {' '.join(args)}  ({time.time() - t:.1f} s, rc {out.returncode})\n"
                        f"{out.stdout[-8000:]}\n{out.stderr[-8000:]}")
        return out

    def up(self, attempts: int = 2) -> float:
        """`ray up`; once more with fresh ports if it fails (another process may take a port we picked)."""
        t = time.time()
        for attempt in range(attempts):
            out = self.ray("up", "-y", "--no-config-cache", str(self.config_path))
            if out.returncode == 0:
                return time.time() - t
            self.ray("down", "-y", str(self.config_path))
            if attempt + 1 < attempts:
                self.gcs_port, self.dashboard_port, self.metrics_port = free_port(), free_port(), free_port()
                self.render()
        raise AssertionError("ray up failed:\n" + "\n".join(self.log))

    def down(self) -> float:
        t = time.time()
        out = self.ray("down", "-y", str(self.config_path))
        assert out.returncode == 0, "\n".join(self.log)
        return time.time() - t

    def serve(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        t = time.time()
        out = subprocess.run([str(Path(sys.executable).parent / "serve"), *args], cwd=ROOT, env=self.env(),
                             capture_output=True, text=True, timeout=timeout)
        self.log.append(f"$ serve {' '.join(args)}  ({time.time() - t:.1f} s, rc {out.returncode})\n"
                        f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        return out

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"
