#!/usr/bin/python3
"""The checks of deploy/k8s that are moerun's own, and the YAML -> JSON step for the schema check.

  /usr/bin/python3 tests/deploy/k8s_validate.py deploy/k8s/base OUT.json [CRD.yaml CRD_OUT.json]

Reads every *.yaml in the base (the manifests) and renders DIR/../overlays/* (their JSON patches), writes them as a JSON array of {file, object} for
tests/deploy/k8s_validate.js, converts the MPIJob CRD if given, and checks that the manifests
agree with each other and with what moerun expects: the probes and the scrape annotations on
the config's metrics port, the token file from the Secret with a mode moerun accepts, the
launcher's -np equal to the worker pods' slots, one image whose tag is the project's version,
the Services on the config's ports, the kustomization listing every manifest. One line per
failure; exit 1 if any.
"""
import json
import os
import re
import sys

import yaml

failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL " + msg)


def check(cond, msg):
    if not cond:
        fail(msg)
    return cond


def port_of(hostport, what):
    m = re.fullmatch(r"(.*):(\d+)", hostport or "")
    if not m:
        fail(f"{what}: '{hostport}' is not HOST:PORT")
        return None, None
    return m.group(1), int(m.group(2))


def pointer_set(doc, path, op, value):
    """One JSON-patch (RFC 6902) add or replace on doc."""
    keys = [k.replace("~1", "/").replace("~0", "~") for k in path.lstrip("/").split("/")]
    node = doc
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if isinstance(node, list):
        if op == "add":
            node.insert(len(node) if last == "-" else int(last), value)
        else:
            node[int(last)] = value
    else:
        if op == "replace" and last not in node:
            raise KeyError(f"replace of missing {path}")
        node[last] = value


def render_overlays(base, objects):
    """What kustomize makes of each ../overlays/*/ on the base: its JSON patches applied. Checks
    that a GPU limit and MOERUN_DEVICE=cuda go together."""
    out = []
    root = os.path.join(base, "..", "overlays")
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        with open(os.path.join(root, name, "kustomization.yaml")) as fh:
            k = yaml.safe_load(fh)
        if not check(k.get("resources") == ["../../base"], f"overlays/{name}: resources must be [../../base]"):
            continue
        objs = [(f, json.loads(json.dumps(o))) for f, o in objects if f in k_resources(base)]
        for p in k.get("patches", []):
            t = p["target"]
            hit = [o for _, o in objs if o["kind"] == t["kind"] and o["metadata"]["name"] == t.get("name")]
            check(len(hit) == 1, f"overlays/{name}: patch target {t} matches {len(hit)} objects")
            for o in hit:
                for op in yaml.safe_load(p["patch"]):
                    check(op["op"] in ("add", "replace"), f"overlays/{name}: op {op['op']} (this check knows add, replace)")
                    try:
                        pointer_set(o, op["path"], op["op"], op["value"])
                    except (KeyError, IndexError, ValueError, TypeError) as e:
                        fail(f"overlays/{name}: {op['path']}: {e}")
        for f, o in objs:
            out.append((f"overlays/{name} {f}", o))
            if o["kind"] != "MPIJob":
                continue
            reps = o["spec"]["mpiReplicaSpecs"]
            gpu = "nvidia.com/gpu" in reps["Worker"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})
            env = {e["name"]: e.get("value") for e in reps["Launcher"]["template"]["spec"]["containers"][0].get("env", [])}
            check(gpu == (env.get("MOERUN_DEVICE") == "cuda"),
                  f"overlays/{name}: nvidia.com/gpu limit ({gpu}) and MOERUN_DEVICE={env.get('MOERUN_DEVICE')} disagree")
            print(f"overlays/{name}: MPIJob rendered, GPU {gpu}, MOERUN_DEVICE={env.get('MOERUN_DEVICE')}")
            ref = os.environ.get("K8S_RENDERED_" + name.upper())
            if ref:  # kubectl kustomize's output of the same overlay
                with open(ref) as fh:
                    theirs = [x for x in yaml.safe_load_all(fh) if x and x["kind"] == "MPIJob"]
                check(theirs and theirs[0]["spec"] == o["spec"],
                      f"overlays/{name}: kubectl kustomize renders the MPIJob's spec differently")
                print(f"overlays/{name}: the same MPIJob spec as kubectl kustomize")
    return out


def k_resources(base):
    with open(os.path.join(base, "kustomization.yaml")) as fh:
        return yaml.safe_load(fh).get("resources", [])


def main():
    if len(sys.argv) not in (3, 5):
        print("usage: k8s_validate.py DIR OUT.json [CRD.yaml CRD_OUT.json]", file=sys.stderr)
        return 2
    d, out = sys.argv[1], sys.argv[2]
    repo = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

    objects = []  # (file, object)
    files = sorted(f for f in os.listdir(d) if f.endswith(".yaml") and f != "kustomization.yaml")
    for f in files:
        try:
            with open(os.path.join(d, f)) as fh:
                docs = [x for x in yaml.safe_load_all(fh) if x is not None]
        except yaml.YAMLError as e:
            fail(f"{f}: not valid YAML: {e}")
            continue
        for o in docs:
            if not (isinstance(o, dict) and o.get("apiVersion") and o.get("kind")):
                fail(f"{f}: a document without apiVersion and kind")
                continue
            objects.append((f, o))
    rendered = render_overlays(d, objects)
    with open(out, "w") as fh:
        json.dump([{"file": f, "object": o} for f, o in objects + rendered], fh)
    if len(sys.argv) == 5:
        with open(sys.argv[3]) as fh:
            crds = [x for x in yaml.safe_load_all(fh) if x]
        crd = [c for c in crds if c.get("kind") == "CustomResourceDefinition"
               and c["spec"]["names"]["kind"] == "MPIJob"]
        if not check(crd, f"{sys.argv[3]}: no CustomResourceDefinition of MPIJob"):
            return 1
        with open(sys.argv[4], "w") as fh:
            json.dump(crd[0], fh)

    def one(kind, name=None):
        got = [(f, o) for f, o in objects
               if o["kind"] == kind and (name is None or o["metadata"].get("name") == name)]
        check(len(got) == 1, f"expected one {kind} {name or ''}, found {len(got)}")
        return got[0] if got else (None, None)

    # The kustomization lists every manifest but the documented extras.
    with open(os.path.join(d, "kustomization.yaml")) as fh:
        kust_text = fh.read()
    kust = yaml.safe_load(kust_text)
    listed = kust.get("resources", [])
    for r in listed:
        check(os.path.exists(os.path.join(d, r)), f"kustomization.yaml lists {r}, which is missing")
    for f in files:
        if f not in listed:
            check(f in kust_text, f"{f} is neither in kustomization.yaml's resources nor named in its comments")
    ns = kust.get("namespace")

    # The serve config.
    _, cm = one("ConfigMap", "moerun-config")
    _, job = one("MPIJob")
    _, secret = one("Secret", "moerun-token")
    if not (cm and job and secret):
        return 1
    cfg = yaml.safe_load(cm["data"]["serve.yaml"])
    serving = cfg.get("serving", {})
    check(cfg.get("transport") == "ucx",
          "serve.yaml: transport must be ucx (a job on mpi cannot outlive a rank nor take --join)")
    _, metrics_port = port_of(serving.get("metrics_listen"), "serving.metrics_listen")
    _, serve_port = port_of(serving.get("listen"), "serving.listen")
    chost, control_port = port_of(serving.get("control_listen"), "serving.control_listen")
    check(chost not in ("127.0.0.1", "localhost"),
          "serving.control_listen must not be loopback: the control Service could not reach it")
    token_file = serving.get("token_file", "")
    check(token_file.startswith("/"), "serving.token_file must be an absolute path in the pod")
    secret_keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
    check(len(secret_keys) == 1, f"Secret moerun-token: expected one key, found {sorted(secret_keys)}")

    # The version the image tag must carry.
    with open(os.path.join(repo, "CMakeLists.txt")) as fh:
        version = re.search(r"project\(moerun VERSION (\S+)", fh.read()).group(1)
    images = set()

    spec = job["spec"]
    known = {"mpiReplicaSpecs", "runPolicy", "slotsPerWorker", "sshAuthMountPath",
             "mpiImplementation", "launcherCreationPolicy", "runLauncherAsWorker"}
    check(set(spec) <= known, f"MPIJob spec: unknown fields {sorted(set(spec) - known)}")
    check(spec.get("mpiImplementation", "OpenMPI") == "OpenMPI",
          "MPIJob: mpiImplementation must be OpenMPI (the image's mpirun)")
    reps = spec["mpiReplicaSpecs"]
    check(set(reps) == {"Launcher", "Worker"}, f"MPIJob: replica types {sorted(reps)}, want Launcher and Worker")
    for t, rs in reps.items():
        check(rs.get("restartPolicy", "Never") in ("Always", "OnFailure", "Never", "ExitCode"),
              f"MPIJob {t}: restartPolicy {rs.get('restartPolicy')}")

    def pods():
        for f, o in objects:
            if o["kind"] == "MPIJob":
                for t, rs in o["spec"]["mpiReplicaSpecs"].items():
                    yield f"{f} {t}", rs["template"]
            elif o["kind"] == "Job":
                yield f"{f} Job", o["spec"]["template"]

    def volume(tpl, name):
        return next((v for v in tpl["spec"].get("volumes", []) if v["name"] == name), None)

    # Every pod: non-root, no privilege escalation, limits, one image; every moerun pod reads
    # the token from the Secret at the config's token_file path, with a mode moerun accepts.
    for where, tpl in pods():
        psc = tpl["spec"].get("securityContext", {})
        check(psc.get("runAsNonRoot") is True, f"{where}: pod securityContext.runAsNonRoot must be true")
        for c in tpl["spec"]["containers"]:
            images.add(c.get("image"))
            sc = c.get("securityContext", {})
            check(sc.get("allowPrivilegeEscalation") is False,
                  f"{where} {c['name']}: allowPrivilegeEscalation must be false")
            check("ALL" in sc.get("capabilities", {}).get("drop", []), f"{where} {c['name']}: drop ALL capabilities")
            lim = c.get("resources", {}).get("limits", {})
            check("memory" in lim and "cpu" in lim, f"{where} {c['name']}: cpu and memory limits")
            runs_moerun = "Launcher" not in where
            if not runs_moerun:
                continue
            mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
            tv = next((v for v in tpl["spec"].get("volumes", [])
                       if v.get("secret", {}).get("secretName") == "moerun-token"), None)
            if check(tv and tv["name"] in mounts, f"{where}: the Secret moerun-token is not mounted"):
                key = next(iter(secret_keys)) if secret_keys else "?"
                check(os.path.join(mounts[tv["name"]], key) == token_file,
                      f"{where}: the token is mounted at {mounts[tv['name']]}/{key}, the config reads {token_file}")
                mode = tv["secret"].get("defaultMode", 0o644)
                check(mode & 0o007 == 0, f"{where}: token defaultMode {oct(mode)}: moerun refuses a token file others can read")
            cv = next((v for v in tpl["spec"].get("volumes", [])
                       if v.get("configMap", {}).get("name") == "moerun-config"), None)
            check(cv and mounts.get(cv["name"]) == "/etc/moerun", f"{where}: the ConfigMap is not mounted at /etc/moerun")
            env = {e["name"] for e in c.get("env", [])}
            if "Job" in where:
                check("UCX_TLS" in env, f"{where}: UCX_TLS must match the job's")
    check(images == {f"moerun-mpi:{version}"}, f"images {sorted(images)}: want one, moerun-mpi:{version}")
    for im in kust.get("images", []):
        check(f"{im['newName']}:{im['newTag']}" == f"moerun-mpi:{version}",
              f"kustomization.yaml images: {im} is not moerun-mpi:{version}")

    # The launcher: one rank per slot, recovery on, the environment forwarded, the metrics port trick.
    launcher = reps["Launcher"]["template"]["spec"]["containers"][0]
    cmd = launcher["command"] + launcher.get("args", [])
    workers = reps["Worker"].get("replicas", 1) * spec.get("slotsPerWorker", 1)
    check(cmd[0] == "mpirun", "Launcher: the command must be mpirun")
    check("-np" in cmd and cmd[cmd.index("-np") + 1] == str(workers),
          f"Launcher: -np must be {workers} (Worker replicas x slotsPerWorker)")
    check(cfg.get("routers", 1) < workers, "serve.yaml: routers must leave expert ranks")
    check("--enable-recovery" in cmd, "Launcher: mpirun --enable-recovery (the job outlives a dead rank)")
    forwarded = {cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == "-x"}
    lenv = {e["name"] for e in launcher.get("env", [])}
    for v in ("UCX_TLS", "MOERUN_DEVICE"):
        check(v in forwarded and v in lenv, f"Launcher: {v} set and forwarded with -x")
    script = cmd[-1]
    check(f"--metrics-listen 0.0.0.0:$(({metrics_port} - OMPI_COMM_WORLD_RANK))" in script,
          f"Launcher: each rank must get --metrics-listen 0.0.0.0:$(({metrics_port} - OMPI_COMM_WORLD_RANK))")
    check('--device "$MOERUN_DEVICE"' in script, 'Launcher: moerun serve --device "$MOERUN_DEVICE"')
    check("--config /etc/moerun/serve.yaml" in script, "Launcher: moerun serve --config /etc/moerun/serve.yaml")
    check(job["spec"].get("sshAuthMountPath", "/root/.ssh").startswith("/home/moerun"),
          "MPIJob: sshAuthMountPath must be the image user's home (/home/moerun/.ssh)")

    # The workers: probes and scrape annotations on the config's metrics port.
    wt = reps["Worker"]["template"]
    rank = wt["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in rank.get("ports", [])}

    def probe_port(p):
        v = p["httpGet"]["port"]
        return named.get(v) if isinstance(v, str) else v

    check(rank.get("readinessProbe"), "Worker: readinessProbe missing")
    for probe, path in (("readinessProbe", "/health/ready"), ("livenessProbe", "/health/live"),
                        ("startupProbe", "/health/live")):
        p = rank.get(probe)
        if p and check("httpGet" in p, f"Worker: {probe} must be an httpGet"):
            check(p["httpGet"].get("path") == path, f"Worker: {probe} path {p['httpGet'].get('path')}, want {path}")
            check(probe_port(p) == metrics_port, f"Worker: {probe} port {p['httpGet']['port']}, the config's metrics port is {metrics_port}")
    ann = wt["metadata"].get("annotations", {})
    check(ann.get("prometheus.io/scrape") == "true", "Worker: prometheus.io/scrape: \"true\"")
    check(ann.get("prometheus.io/port") == str(metrics_port), f"Worker: prometheus.io/port must be \"{metrics_port}\"")
    check(ann.get("prometheus.io/path") == "/metrics", "Worker: prometheus.io/path must be /metrics")
    check(named.get("metrics") == metrics_port and named.get("serve") == serve_port
          and named.get("control") == control_port,
          f"Worker: container ports {named} must match the config (serve {serve_port}, control {control_port}, metrics {metrics_port})")

    # The Services reach router 0 on the config's ports; the PodMonitor and join Job agree.
    for name, port in (("moerun-serve", serve_port), ("moerun-control", control_port), ("moerun-metrics", metrics_port)):
        _, svc = one("Service", name)
        if not svc:
            continue
        sp = svc["spec"]["ports"][0]
        tp = sp.get("targetPort", sp["port"])
        check((named.get(tp) if isinstance(tp, str) else tp) == port, f"Service {name}: targets {tp}, want the config's {port}")
        sel = svc["spec"]["selector"]
        check(sel.get("training.kubeflow.org/job-name") == job["metadata"]["name"]
              and sel.get("training.kubeflow.org/job-role") == "worker",
              f"Service {name}: selector {sel} does not select the job's workers")
        if name != "moerun-metrics":
            check(sel.get("training.kubeflow.org/replica-index") == "0",
                  f"Service {name}: must select worker 0 (rank 0 = router 0)")
    _, pm = one("PodMonitor")
    if pm:
        ep = pm["spec"]["podMetricsEndpoints"][0]
        check(named.get(ep.get("port")) == metrics_port and ep.get("path", "/metrics") == "/metrics",
              "PodMonitor: must scrape the metrics port's /metrics")
    _, jj = one("Job")
    if jj:
        jc = jj["spec"]["template"]["spec"]["containers"][0]["command"]
        check("--join" in jc and jc[jc.index("--join") + 1] == f"moerun-control:{control_port}",
              f"join Job: --join must be moerun-control:{control_port}")
        check("--device" not in jc or jc[jc.index("--device") + 1] == "cpu", "join Job: --join refuses --device cuda")
    for f, o in objects:
        n = o["metadata"].get("namespace")
        check(n in (None, ns), f"{f}: {o['kind']} in namespace {n}, kustomization's is {ns}")

    print(f"k8s_validate.py: {len(objects)} objects in {len(files)} files, "
          f"{'no' if not failures else len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
