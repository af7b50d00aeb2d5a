"""A single-node Slurm cluster on loopback, started from a private directory.

munged, slurmctld and slurmd run in the foreground as children of the test process, on
free loopback ports, with their key, state, spool and logs in that directory; SLURM_CONF
points the daemons and client commands at its slurm.conf. The executor plugin's job step
drops SLURM_CONF before its nested srun, which then reads the node-wide
/etc/slurm/slurm.conf (as on a real cluster node), so that path is linked to the
cluster's config while it runs; a machine that already has its own Slurm config there
cannot host the test cluster. Accounting is off (no slurmdbd): job states come from
slurmctld, which keeps finished jobs for MinJobAge seconds.
"""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

# Debian puts the daemons in /usr/sbin, which is not on every user's PATH.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")
NODE_CONF = Path("/etc/slurm/slurm.conf")
# Where setup.sh installs the executor plugin (envs/cluster/requirements.lock); cluster
# runs put it on PYTHONPATH.
PLUGIN_DIR = Path(__file__).resolve().parents[1] / ".venv" / "cluster"
# Seconds a daemon gets to come up (or a cancelled job to end) before we call it stuck.
START_TIMEOUT = 60
# Finished jobs stay visible to squeue and scontrol this long (seconds): longer than
# any test run, so the test can read every job's allocation after the build.
MIN_JOB_AGE = 3600


def _which(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def unavailable_reason() -> str | None:
    missing = [name for name in DAEMONS + CLIENTS if _which(name) is None]
    if missing:
        return (
            f"{', '.join(missing)} not installed (Debian's slurm-wlm and munge packages; "
            ".ci/run installs them via envs/base/setup-slurm.sh when run as root with apt)"
        )
    if not (PLUGIN_DIR / "snakemake_executor_plugin_slurm").is_dir():
        return (
            f"snakemake-executor-plugin-slurm is not in {PLUGIN_DIR}: rerun bash setup.sh "
            "now that Slurm is installed (it installs envs/cluster/requirements.lock there)"
        )
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs (run the test as root)"
    if os.path.lexists(NODE_CONF) and _link_target_exists(NODE_CONF):
        return f"{NODE_CONF} exists: this machine has its own Slurm (or another test cluster)"
    return None


def _link_target_exists(path: Path) -> bool:
    return not path.is_symlink() or path.resolve().exists()


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all held open at once while choosing)."""
    probes = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def _tail(path: Path, lines=15) -> str:
    if not path.is_file():
        return f"({path.name} was not written)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class ClusterError(RuntimeError):
    pass


class Cluster:
    """munged + slurmctld + slurmd for one node (this machine) in ``root``.

    Use as a context manager: leaving it cancels every job and stops the daemons,
    whatever happened inside.
    """

    PARTITION = "npuforge"

    def __init__(self, root: Path):
        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.logs = self.root / "log"
        self._daemons: list[tuple[str, subprocess.Popen]] = []
        self._linked = False
        self.node = socket.gethostname().split(".")[0]

    @property
    def env(self) -> dict:
        """Environment for a Slurm command (or a Snakemake run submitting through it)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = _SEARCH_PATH
        return env

    def command(self, *args, check=True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [_which(args[0]) or args[0], *map(str, args[1:])],
            capture_output=True, text=True, env=self.env, timeout=START_TIMEOUT,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise ClusterError(f"{' '.join(map(str, args))}: {result.stderr.strip()}")
        return result

    def _node_line(self) -> str:
        """The node as slurmd itself measures it (real CPUs and memory)."""
        probe = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=True)
        words = probe.stdout.split()
        hardware = [w for w in words if w.split("=")[0] in (
            "CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory"
        )]  # fmt: skip
        return f"NodeName={self.node} NodeAddr=127.0.0.1 {' '.join(hardware)} State=UNKNOWN"

    def _write_config(self):
        self.root.mkdir(parents=True, exist_ok=True)
        munge_dir = self.root / "munge"
        # munged insists: key readable by its owner only, socket directory searchable by all.
        munge_dir.mkdir(mode=0o700)
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        run_dir = self.root / "run"
        run_dir.mkdir(mode=0o755)
        run_dir.chmod(0o755)
        for part in ("state", "spool", "log"):
            (self.root / part).mkdir()
        self.munge_socket = run_dir / "munge.socket"
        controller_port, node_port = _free_ports(2)
        self.conf.write_text(
            "\n".join([
                "ClusterName=npuforgetest",
                f"SlurmctldHost={self.node}(127.0.0.1)",
                "SlurmUser=root",
                f"SlurmctldPort={controller_port}",
                f"SlurmdPort={node_port}",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.munge_socket}",
                f"StateSaveLocation={self.root / 'state'}",
                f"SlurmdSpoolDir={self.root / 'spool'}",
                f"SlurmctldPidFile={run_dir / 'slurmctld.pid'}",
                f"SlurmdPidFile={run_dir / 'slurmd.pid'}",
                f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
                f"SlurmdLogFile={self.logs / 'slurmd.log'}",
                # No cgroups: track job processes by parentage, bind no tasks.
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "MpiDefault=none",
                # CPUs and memory are both consumable: a job gets what it asked for.
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core_Memory",
                f"MinJobAge={MIN_JOB_AGE}",
                "ReturnToService=2",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/none",
                self._node_line(),
                f"PartitionName={self.PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
                "",
            ])
        )  # fmt: skip

    def _spawn(self, name: str, *args):
        log = open(self.logs / f"{name}.out", "wb")
        process = subprocess.Popen(
            [_which(name), *map(str, args)], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=self.env,
        )  # fmt: skip
        log.close()
        self._daemons.append((name, process))
        return process

    def _wait(self, what: str, ready, logs: list[Path]):
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            for name, process in self._daemons:
                if process.poll() is not None:
                    raise ClusterError(
                        f"{name} exited with {process.returncode} while waiting for {what}:\n"
                        + "\n".join(_tail(log) for log in logs)
                    )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{what} not ready after {START_TIMEOUT} s:\n"
                    + "\n".join(_tail(log) for log in logs)
                )
            time.sleep(0.5)

    def _link_node_conf(self):
        if NODE_CONF.is_symlink() and not NODE_CONF.resolve().exists():
            NODE_CONF.unlink()  # left by a test run that was killed
        NODE_CONF.parent.mkdir(parents=True, exist_ok=True)
        try:
            NODE_CONF.symlink_to(self.conf)
        except FileExistsError:
            raise ClusterError(f"{NODE_CONF} exists: another Slurm config is in place") from None
        self._linked = True

    def start(self):
        self._write_config()
        self._link_node_conf()
        munge_dir = self.root / "munge"
        # --force: the socket lives under the test's private (0700) temp directory,
        # which munged would otherwise refuse as not searchable by every user.
        self._spawn(
            "munged", "--foreground", "--force", f"--key-file={munge_dir / 'munge.key'}",
            f"--socket={self.munge_socket}", f"--pid-file={self.root / 'run' / 'munged.pid'}",
            f"--log-file={self.logs / 'munged.log'}", f"--seed-file={munge_dir / 'munged.seed'}",
        )  # fmt: skip
        self._wait("munged", self.munge_socket.exists, [self.logs / "munged.out"])
        # -i: ignore (absent) saved state; -D: stay in the foreground as our child.
        self._spawn("slurmctld", "-D", "-i")
        self._spawn("slurmd", "-D", "-N", self.node)
        self._wait(
            f"node {self.node}",
            lambda: (
                self.command("sinfo", "--noheader", "--format=%t", check=False).stdout.strip()
                == "idle"
            ),
            [self.logs / name for name in ("slurmctld.out", "slurmctld.log", "slurmd.log")],
        )

    def stop(self):
        """Cancel every job, wait for them to end, then stop slurmd, slurmctld and munged."""
        if any(name == "slurmctld" and p.poll() is None for name, p in self._daemons):
            self.command("scancel", f"--partition={self.PARTITION}", check=False)
            deadline = time.monotonic() + START_TIMEOUT
            while time.monotonic() < deadline:
                listing = self.command(
                    "squeue", "--noheader", "--format=%i", "--states=PENDING,RUNNING,COMPLETING",
                    check=False,
                )  # fmt: skip
                if listing.returncode != 0 or not listing.stdout.strip():
                    break
                time.sleep(0.5)
        for _, process in reversed(self._daemons):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self._daemons.clear()
        if self._linked and NODE_CONF.is_symlink() and NODE_CONF.resolve() == self.conf.resolve():
            NODE_CONF.unlink()
        self._linked = False

    def jobs(self) -> list[dict]:
        """Every job slurmctld knows (finished ones included), as scontrol's key=value."""
        listing = self.command("scontrol", "show", "job", "--oneliner").stdout
        return [
            dict(field.split("=", 1) for field in line.split() if "=" in field)
            for line in listing.splitlines()
            if line.startswith("JobId=")
        ]

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()
