"""docker/kubernetes (kustomize): every manifest is valid against Kubernetes' own schemas (strict: no unknown
field), and the pieces fit together: the pods run real vbatch commands on the ports their probes and Service use,
read the ConfigMap and Secret that exist, probe paths the app serves, and the worker asks for a GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "docker" / "kubernetes"
KUBERNETES = "1.32"


def rendered() -> list[dict]:
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs.extend(doc for doc in yaml.safe_load_all((MANIFESTS / name).read_text()) if doc)
    return docs


def by_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in rendered() if doc["kind"] == kind}


def test_every_manifest_is_valid_kubernetes():
    docs = rendered()
    assert {doc["kind"] for doc in docs} == {"Namespace", "ConfigMap", "Secret", "Deployment", "Service"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises on an unknown or missing field


def test_the_pods_run_vbatch_roles_on_the_ports_their_probes_and_service_use():
    served = yaml.safe_load((ROOT / "openapi.yaml").read_text())["paths"]
    config, secret = by_kind("ConfigMap"), by_kind("Secret")
    deployments = by_kind("Deployment")
    roles = {}
    for deployment in deployments.values():
        pod = deployment["spec"]["template"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        [container] = pod["spec"]["containers"]
        command = container["command"]
        assert command[:1] == ["vbatch"] and command[1] in ("api", "worker")
        roles[command[1]] = container
        port = int(command[command.index("--port") + 1])
        assert [p["containerPort"] for p in container["ports"]] == [port]
        for source in container["envFrom"]:
            ref = source.get("configMapRef") or source["secretRef"]
            assert ref["name"] in (config if "configMapRef" in source else secret)
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container and "httpGet" in container[probe]:
                assert container[probe]["httpGet"]["path"] in served
    assert roles.keys() == {"api", "worker"}
    assert roles["worker"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    [service] = by_kind("Service").values()
    api_pod = deployments["vbatch-api"]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= api_pod.items()
    # What every process needs to share state: the store in the ConfigMap, the database and keys in the Secret.
    [settings] = config.values()
    [credentials] = secret.values()
    assert settings["data"]["VBATCH_STORAGE_URL"].startswith("s3://")
    assert {"VBATCH_DATABASE_URL", "VBATCH_API_KEYS", "VBATCH_FLEET_SECRET"} <= credentials["stringData"].keys()


def test_the_worker_announces_its_pod_ip_and_port_to_the_api_replicas():
    [container] = by_kind("Deployment")["vbatch-worker"]["spec"]["template"]["spec"]["containers"]
    env = {variable["name"]: variable for variable in container["env"]}
    port = container["ports"][0]["containerPort"]
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # Kubernetes expands $(NAME) from the variables listed before it.
    assert list(env).index("POD_IP") < list(env).index("VBATCH_ADVERTISE_URL")
    assert env["VBATCH_ADVERTISE_URL"]["value"] == f"http://$(POD_IP):{port}"


def test_kubectl_renders_the_same_resources_where_it_is_installed():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (the schema checks above run without it)")
    output = subprocess.run([kubectl, "kustomize", str(MANIFESTS)], check=True, capture_output=True, text=True)
    docs = [doc for doc in yaml.safe_load_all(output.stdout) if doc]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in rendered()
    )
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"vbatch"}
