"""What the rendered chart means: the processes it runs are real CLI commands, its config.yaml is a valid
Settings file, pods are locked down, GPUs, drain, discovery, probes, Redis durability and network policy."""

from __future__ import annotations

from typing import Any

import pytest

from clients.cli import build_parser
from control_plane.config import Settings
from tests.deploy.chart_render import (
    NAMESPACE,
    RELEASE,
    Manifest,
    coalesce_commands,
    config_yaml,
    find,
    gpu_values,
    pod_specs,
    render,
)
from tests.deploy.test_chart import EVERYTHING_ON


def settings_from(config: dict[str, Any]) -> Settings:
    return Settings(**config)  # extra="forbid": a key Settings does not know fails here


@pytest.mark.parametrize("values", [{}, gpu_values(), EVERYTHING_ON], ids=["default", "gpu", "everything-on"])
def test_config_yaml_is_valid_settings(values: dict[str, Any]) -> None:
    config = config_yaml(render(values))
    settings = settings_from(config)
    assert settings.host == "0.0.0.0"
    assert settings.worker.host == "0.0.0.0"
    assert settings.metrics_port > 0


def test_worker_weights_and_kv_cache_dtype_reach_the_workers() -> None:
    assert settings_from(config_yaml(render({}))).worker.weights == "dense"
    config = config_yaml(render({"worker": {"weights": "auto", "kvCacheDtype": "int8"}}))
    worker = settings_from(config).worker
    assert (worker.weights, worker.kv_cache_dtype) == ("auto", "int8")


@pytest.mark.parametrize("values", [{}, EVERYTHING_ON], ids=["default", "everything-on"])
def test_containers_run_real_cli_commands(values: dict[str, Any]) -> None:
    commands = coalesce_commands(render(values))
    assert set(commands) >= {"control-plane", "worker"}
    parser = build_parser()
    for name, argv in commands.items():
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"container {name} runs {argv}, which `coalesce` rejects")
        assert args.command == name
        assert args.config == "/etc/coalesce/config.yaml"


def test_workers_found_through_a_headless_service() -> None:
    docs = render()
    svc = find(docs, "Service", f"{RELEASE}-worker")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["publishNotReadyAddresses"] is False  # a worker still loading is not discovered
    workers = find(docs, "StatefulSet", f"{RELEASE}-worker")
    assert workers["spec"]["serviceName"] == svc["metadata"]["name"]
    pod_labels = workers["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    config = config_yaml(docs)
    assert config["worker_dns"] == f"{RELEASE}-worker.{NAMESPACE}.svc:{config['worker']['port']}"


def test_every_pod_is_locked_down() -> None:
    for values in ({}, EVERYTHING_ON):
        for workload, spec in pod_specs(render(values)):
            name = workload["metadata"]["name"]
            assert spec["securityContext"]["runAsNonRoot"] is True, name
            assert spec["automountServiceAccountToken"] is False, name
            for c in spec["containers"] + spec.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
                assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
                assert sc["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])


def _container(doc: Manifest) -> Manifest:
    container: Manifest = doc["spec"]["template"]["spec"]["containers"][0]
    return container


def test_gpu_workers_get_one_gpu_shm_and_gpu_nodes() -> None:
    gpu = find(render(gpu_values()), "StatefulSet", f"{RELEASE}-worker")
    spec = gpu["spec"]["template"]["spec"]
    assert _container(gpu)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in _container(gpu)["volumeMounts"]
    model = next(v for v in spec["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}

    cpu = find(render(), "StatefulSet", f"{RELEASE}-worker")
    assert "nvidia.com/gpu" not in str(cpu)
    assert config_yaml(render())["worker"]["model"] == "smollm2"  # baked into the CPU image


def test_model_from_an_init_container_lands_where_the_worker_reads_it() -> None:
    docs = render(EVERYTHING_ON)
    spec = find(docs, "StatefulSet", f"{RELEASE}-worker")["spec"]["template"]["spec"]
    init = spec["initContainers"][0]
    assert init["image"] == "busybox:1.37"
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
    assert config_yaml(docs)["worker"]["model"] == "/models/smol"


def test_control_plane_drains_within_its_grace_period() -> None:
    for values in ({}, gpu_values()):
        docs = render(values)
        drain_s = config_yaml(docs)["drain_s"]
        pod = find(docs, "Deployment", f"{RELEASE}-control-plane")["spec"]["template"]["spec"]
        container = pod["containers"][0]
        pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > pre_stop + drain_s
        liveness = container["livenessProbe"]
        # A draining control plane reports NOT_SERVING: liveness must not restart it before the drain ends.
        assert liveness["periodSeconds"] * liveness["failureThreshold"] > pre_stop + drain_s


def test_native_grpc_probes_on_plaintext_ports() -> None:
    docs = render()
    for name in ("control-plane", "worker"):
        kind = "Deployment" if name == "control-plane" else "StatefulSet"
        c = _container(find(docs, kind, f"{RELEASE}-{name}"))
        port = c["ports"][0]["containerPort"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"] == {"port": port}, (name, probe)


def test_a_pdb_and_an_hpa_on_waiting_requests() -> None:
    docs = render(gpu_values())
    pdb = find(docs, "PodDisruptionBudget", f"{RELEASE}-control-plane")
    assert pdb["spec"]["minAvailable"] == 1
    hpa = find(docs, "HorizontalPodAutoscaler", f"{RELEASE}-control-plane")
    (metric,) = hpa["spec"]["metrics"]
    # The series control_plane/telemetry/metrics.py exports (per worker and pool).
    assert metric["pods"]["metric"]["name"] == "coalesce_waiting_sequences"
    assert "replicas" not in find(docs, "Deployment", f"{RELEASE}-control-plane")["spec"]  # the HPA owns it


def test_bundled_redis_keeps_an_fsynced_aof_and_never_evicts() -> None:
    docs = render()
    conf = find(docs, "ConfigMap", f"{RELEASE}-redis")["data"]["redis.conf"].splitlines()
    for line in ("appendonly yes", "appendfsync everysec", "maxmemory-policy noeviction"):
        assert line in conf
    redis = find(docs, "StatefulSet", f"{RELEASE}-redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert config_yaml(docs)["store"] == f"redis://{RELEASE}-redis:6379/0"


def test_a_store_url_with_a_password_comes_from_a_secret() -> None:
    for values, secret in (({"redis": {"auth": {"existingSecret": "pw"}}}, "pw"), (gpu_values(), "coalesce-redis")):
        docs = render(values)
        assert "store" not in config_yaml(docs)
        env = {e["name"]: e for e in _container(find(docs, "Deployment", f"{RELEASE}-control-plane"))["env"]}
        ref = env.get("REDIS_PASSWORD", env["COALESCE_STORE"])["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret


def _allowed_from(policy: Manifest) -> list[dict[str, str]]:
    return [peer["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"] for peer in rule["from"]]


def test_network_policy_lets_only_control_planes_reach_workers_and_redis() -> None:
    docs = render()
    cp_labels = find(docs, "Deployment", f"{RELEASE}-control-plane")["spec"]["template"]["metadata"]["labels"]
    for target, kind in (("worker", "StatefulSet"), ("redis", "StatefulSet")):
        policy = find(docs, "NetworkPolicy", f"{RELEASE}-{target}")
        pod_labels = find(docs, kind, f"{RELEASE}-{target}")["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
        (allowed,) = _allowed_from(policy)
        assert allowed.items() <= cp_labels.items()
        assert allowed["app.kubernetes.io/component"] == "control-plane"


def test_auth_tls_and_mtls_are_wired_as_files() -> None:
    docs = render(EVERYTHING_ON)
    config = config_yaml(docs)
    assert config["auth"] == {"tokens_file": "/etc/coalesce/auth/tokens.yaml"}
    assert config["tls"]["client_ca_file"] == "/etc/coalesce/tls/ca.crt"
    assert set(config["internal_tls"]) == {"ca_file", "cert_file", "key_file"}
    secret = find(docs, "Secret", f"{RELEASE}-auth")
    assert secret["stringData"]["tokens.yaml"].strip() == f"{'a' * 64}: team-a"
    cp = _container(find(docs, "Deployment", f"{RELEASE}-control-plane"))
    mounts = {m["mountPath"]: m for m in cp["volumeMounts"]}
    # No subPath: the kubelet swaps the file in place when the Secret changes, and the reload sees it.
    assert "subPath" not in mounts["/etc/coalesce/auth"]
    for path in ("/etc/coalesce/tls", "/etc/coalesce/internal-tls"):
        assert mounts[path]["readOnly"] is True
    # Native gRPC probes cannot speak TLS: with TLS on, the probes fall back to a TCP connect.
    assert cp["readinessProbe"]["tcpSocket"] == {"port": 50051}
    assert config_yaml(render({"auth": {"enabled": False}}))["auth"] == {"disabled": True}


def test_traces_go_to_the_bundled_jaeger() -> None:
    docs = render({"jaeger": {"enabled": True}})
    for kind, name in (("Deployment", "control-plane"), ("StatefulSet", "worker")):
        env = {e["name"]: e.get("value") for e in _container(find(docs, kind, f"{RELEASE}-{name}"))["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://{RELEASE}-jaeger:4317"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in str(render())


def test_control_planes_and_workers_share_the_internal_token() -> None:
    for values, secret in (({}, f"{RELEASE}-internal"), ({"internalToken": {"existingSecret": "mine"}}, "mine")):
        docs = render(values)
        refs = []
        for kind, name in (("Deployment", "control-plane"), ("StatefulSet", "worker")):
            env = {e["name"]: e for e in _container(find(docs, kind, f"{RELEASE}-{name}"))["env"]}
            refs.append(env["COALESCE_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"])
        assert refs == [{"name": secret, "key": "token"}] * 2
        made = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == f"{RELEASE}-internal"]
        assert len(made) == (1 if secret == f"{RELEASE}-internal" else 0)
        if made:
            assert len(made[0]["data"]["token"]) >= 48  # base64 of 48 random characters
