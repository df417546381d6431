"""Kubernetes manifests for a topology (pure): a StatefulSet + headless Service per pool, the proxy's Deployment and
Service, and a ConfigMap with the resolved topology.

Rendered from the same plan `pdctl up` runs, with what a cluster decides instead of pdctl: the device plugin picks
the accelerators (a resource request per platform, not device ids), every pod listens on the role's base ports,
and the NIXL side-channel host is the pod's IP. Validated offline (kubernetes-validate --strict); no cluster runs
here to apply them. `monitoring:` renders no Prometheus: every pod carries prometheus.io scrape annotations for the
cluster's own.

With `auth.api_key_env`, every server's VLLM_API_KEY and the proxy's variable come from the Secret
`<topology name>-api-key` (key `api-key`), which the user creates; the manifests hold only the reference.
"""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath

from pdctl.plan import CPU_BIND_ENV, DEVICE_ENV, SIDE_CHANNEL_HOST_ENV, Plan, ProcessSpec
from pdctl.proxy.config import spec_of, upstream, with_spec
from pdctl.topology import DEFAULT_POOL, ROLES, Pool, Topology, is_local_path
from pdctl.topology.transport import NET_DEVICES_ENV, UCX_ACROSS_HOSTS, UCX_ONE_HOST

# The extended resource each platform's device plugin offers.
DEVICE_RESOURCE = {"cuda": "nvidia.com/gpu", "hpu": "habana.ai/gaudi", "xpu": "gpu.intel.com/i915"}
DEFAULT_IMAGE = "vllm/vllm-openai:v0.11.0"
MODELS_MOUNT = "/models"
MODELS_CLAIM = "pdctl-models"
# Set by the plan for one host; in a pod the device plugin and the kubelet decide these.
HOST_ONLY_ENV = {CPU_BIND_ENV, NET_DEVICES_ENV, *DEVICE_ENV.values()}
SECRET_KEY = "api-key"  # the key within the topology's Secret (secret_name) that holds the API key


def scrape_annotations(port: int) -> dict[str, str]:
    """The prometheus.io/* pod annotations Prometheus' kubernetes_sd relabelling conventionally reads: every vLLM
    server and the proxy serve Prometheus text on /metrics. (ServiceMonitor/PodMonitor need the operator's CRDs,
    whose schema kubernetes-validate cannot check offline.)"""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def secret_name(t: Topology) -> str:
    """The Secret the user creates for a topology with auth (key `api-key`): pdctl never renders its value."""
    return dns_name(t.name, "api-key")


def secret_env(t: Topology, spec: ProcessSpec) -> list[dict]:
    """A process's secret variables (its key, auth.api_key_env) as references to that Secret, never values."""
    ref = {"secretKeyRef": {"name": secret_name(t), "key": SECRET_KEY}}
    return [{"name": target, "valueFrom": ref} for target in spec.secret_env]


def dns_name(*parts: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", "-".join(parts).lower()).strip("-")[:63]


def _labels(t: Topology, component: str, pool: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "pdctl", "app.kubernetes.io/instance": dns_name(t.name),
              "app.kubernetes.io/component": component}
    if pool is not None:
        labels["pdctl.dev/pool"] = dns_name(pool)
    return labels


def _model_arg(t: Topology, pool: Pool) -> tuple[str, bool]:
    raw = t.model_path(pool)
    if is_local_path(raw):
        return f"{MODELS_MOUNT}/{PurePosixPath(raw).name}", True
    return raw, False


def _server_container(t: Topology, pool: Pool, spec: ProcessSpec, image: str) -> tuple[dict, bool]:
    argv = ["python3", *spec.argv[1:]]
    argv[argv.index("--host") + 1] = "0.0.0.0"
    model, local = _model_arg(t, pool)
    argv[argv.index("--model") + 1] = model
    # Pods are hosts of their own: UCX's settings across hosts, never the plan's one-host shared-memory lanes
    # (a pool's own env still wins).
    own = {k: v for k, v in spec.env.items() if not (k in UCX_ONE_HOST and v == UCX_ONE_HOST[k])}
    env = [{"name": k, "value": v} for k, v in {**UCX_ACROSS_HOSTS, **own}.items()
           if k not in HOST_ONLY_ENV and k != SIDE_CHANNEL_HOST_ENV]
    env.append({"name": SIDE_CHANNEL_HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    env += secret_env(t, spec)
    if pool.platform in DEVICE_RESOURCE:
        n = str(pool.tp)
        resources = {"requests": {DEVICE_RESOURCE[pool.platform]: n}, "limits": {DEVICE_RESOURCE[pool.platform]: n}}
    else:
        cores = str(len(pool.devices_of(0) or []) or pool.tp)
        resources = {"requests": {"cpu": cores, "memory": "4Gi"}, "limits": {"memory": "16Gi"}}
    c = {
        "name": "vllm", "image": image, "command": argv, "env": env, "resources": resources,
        "ports": [{"name": "http", "containerPort": spec.ports["http"]},
                  {"name": "nixl-side", "containerPort": spec.ports["side_channel"]}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5,
                           "failureThreshold": 3},
        "startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                         "failureThreshold": 90},
    }
    if local:
        c["volumeMounts"] = [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}]
    return c, local


def _proxy_command(argv: list[str], urls: dict[str, list[str]], router: bool) -> list[str]:
    """The plan's proxy command for a pod: listening on every address, and its upstreams the StatefulSets' stable
    pod names instead of the plan's host addresses (no hand-over sockets: those are host-local)."""
    argv = ["python3", *argv[1:]]
    if not router:
        return with_spec(argv, spec_of(argv).model_copy(
            update={"host": "0.0.0.0", "prefill": urls["prefill"], "decode": urls["decode"]}))
    argv[argv.index("--host") + 1] = "0.0.0.0"
    argv[argv.index("--prometheus-host") + 1] = "0.0.0.0"  # its metrics listen apart, on their own port
    kept = [a for k, a in enumerate(argv) if a not in ("--prefill", "--decode")
            and (k == 0 or argv[k - 1] not in ("--prefill", "--decode"))]
    return kept + [a for role in ROLES for u in urls[role] for a in (f"--{role}", u)]


def render(t: Topology, plan: Plan, *, image: str = DEFAULT_IMAGE, namespace: str = "default") -> dict[str, dict]:
    """File name -> manifest."""
    name = dns_name(t.name)
    out: dict[str, dict] = {}
    meta = {"namespace": namespace}
    out["00-topology-configmap.yaml"] = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {**meta, "name": dns_name(name, "topology"), "labels": _labels(t, "topology")},
        "data": {"topology.json": json.dumps(plan.to_dict()["topology"], indent=2)},
    }
    urls: dict[str, list[str]] = {role: [] for role in ROLES}  # [POOL=]URL per instance, as the proxy reads them
    for i, role in enumerate(ROLES, start=1):
        for k, g in enumerate(t.pools(role)):
            # One StatefulSet per pool: a pool is one kind of hardware with one block size.
            spec = next(s for s in plan.by_role(role) if s.pool == g.name)
            svc = dns_name(name, role) if g.name == DEFAULT_POOL else dns_name(name, role, g.name)
            labels = _labels(t, role, g.name)
            container, local = _server_container(t, g, spec, image)
            pod: dict = {"containers": [container]}
            if local:
                pod["volumes"] = [{"name": "models", "persistentVolumeClaim": {"claimName": MODELS_CLAIM,
                                                                                "readOnly": True}}]
            stem = svc.removeprefix(name + "-")
            out[f"{i}{2 * k}-{stem}-service.yaml"] = {
                "apiVersion": "v1", "kind": "Service",
                "metadata": {**meta, "name": svc, "labels": labels},
                "spec": {"clusterIP": "None", "selector": labels, "publishNotReadyAddresses": False,
                         "ports": [{"name": "http", "port": spec.ports["http"], "targetPort": "http"},
                                   {"name": "nixl-side", "port": spec.ports["side_channel"],
                                    "targetPort": "nixl-side"}]},
            }
            out[f"{i}{2 * k + 1}-{stem}-statefulset.yaml"] = {
                "apiVersion": "apps/v1", "kind": "StatefulSet",
                "metadata": {**meta, "name": svc, "labels": labels},
                "spec": {"serviceName": svc, "replicas": g.count, "podManagementPolicy": "Parallel",
                         "selector": {"matchLabels": labels},
                         "template": {"metadata": {"labels": labels,
                                                   "annotations": scrape_annotations(spec.ports["http"])},
                                      "spec": pod}},
            }
            for n in range(g.count):
                url = f"http://{svc}-{n}.{svc}.{namespace}.svc:{spec.ports['http']}"
                urls[role].append(upstream(g.name, url))
    px = plan.by_role("proxy")[0]
    router = t.proxy.kind == "vllm-router"
    metrics_port = px.ports.get("metrics", px.ports["http"])
    labels = _labels(t, "proxy")
    proxy_container: dict = {
        "name": "proxy", "image": image, "command": _proxy_command(px.argv, urls, router),
        "ports": [{"name": "http", "containerPort": px.ports["http"]}] + (
            [{"name": "metrics", "containerPort": metrics_port}] if router else []),
        "readinessProbe": {"httpGet": {"path": "/readiness" if router else "/ready", "port": "http"},
                           "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "resources": {"requests": {"cpu": "1", "memory": "512Mi"}},
    }
    if px.secret_env:  # its spec names the variable (api_key_env); the Secret fills it
        proxy_container["env"] = secret_env(t, px)
    out["30-proxy-deployment.yaml"] = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {**meta, "name": dns_name(name, "proxy"), "labels": labels},
        "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels, "annotations": scrape_annotations(metrics_port)},
                              "spec": {"containers": [proxy_container]}}},
    }
    out["31-proxy-service.yaml"] = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {**meta, "name": dns_name(name, "proxy"), "labels": labels},
        "spec": {"selector": labels, "ports": [{"name": "http", "port": px.ports["http"], "targetPort": "http"}]},
    }
    return out
