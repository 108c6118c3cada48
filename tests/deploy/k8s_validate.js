// Validates Kubernetes objects against the official schemas: reads a JSON array of objects
// (tests/deploy/k8s_validate.py writes it) and, optionally, a CRD's openAPIV3Schema, and prints
// one line per object; exit 1 if any is invalid. Run by tests/deploy/k8s_validate.sh:
//   node tests/deploy/k8s_validate.js OBJECTS.json [MPIJOB_CRD.json]
// Built-in kinds: the npm package kubernetes-models (its validators are compiled from the
// Kubernetes OpenAPI schema); PodMonitor: @kubernetes-models/prometheus-operator; MPIJob: its pod
// templates as core/v1 PodTemplateSpecs and, when given, the whole object against the CRD's
// schema (ajv, unknown fields rejected as kubectl's strict field validation does).
"use strict";
const fs = require("fs");
const path = require("path");

const [objectsFile, crdFile] = process.argv.slice(2);
if (!objectsFile) {
  console.error("usage: node k8s_validate.js OBJECTS.json [MPIJOB_CRD.json]");
  process.exit(2);
}

function need(name) {
  try {
    return require(name);
  } catch (e) {
    console.error(`k8s_validate: cannot load the npm package ${name} (${e.code || e.message}); ` +
                  "install it with scripts/install-deps.sh --test or set NODE_PATH");
    process.exit(2);
  }
}

const modules = {
  "v1": "kubernetes-models/v1",
  "apps/v1": "kubernetes-models/apps/v1",
  "batch/v1": "kubernetes-models/batch/v1",
  "policy/v1": "kubernetes-models/policy/v1",
  "networking.k8s.io/v1": "kubernetes-models/networking.k8s.io/v1",
  "monitoring.coreos.com/v1": "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1",
};

function modelValidate(apiVersion, kind, obj) {
  const mod = modules[apiVersion];
  if (!mod) throw new Error(`no schema for apiVersion ${apiVersion}`);
  const Model = need(mod)[kind];
  if (!Model) throw new Error(`no schema for kind ${kind} in ${apiVersion}`);
  new Model(obj).validate();
}

// An openAPIV3Schema as a JSON schema for ajv: the x-kubernetes-* keywords dropped, objects
// with listed properties closed (unknown fields are errors) unless they preserve unknown fields.
function strictSchema(s) {
  if (Array.isArray(s)) return s.map(strictSchema);
  if (!s || typeof s !== "object") return s;
  const out = {};
  for (const [k, v] of Object.entries(s)) {
    if (k.startsWith("x-kubernetes-") || k === "description" || k === "default") continue;
    out[k] = (k === "properties" || k === "patternProperties")
        ? Object.fromEntries(Object.entries(v).map(([n, sub]) => [n, strictSchema(sub)]))
        : strictSchema(v);
  }
  if (s.properties && s.additionalProperties === undefined &&
      !s["x-kubernetes-preserve-unknown-fields"]) {
    out.additionalProperties = false;
  }
  if (s["x-kubernetes-int-or-string"] && !s.anyOf) out.anyOf = [{type: "integer"}, {type: "string"}];
  return out;
}

let crdValidate = null;
if (crdFile) {
  const crd = JSON.parse(fs.readFileSync(crdFile, "utf8"));
  const version = (crd.spec.versions || []).find((v) => v.name === "v2beta1");
  if (!version) {
    console.error(`k8s_validate: ${crdFile} has no v2beta1 version`);
    process.exit(2);
  }
  // ajv comes with kubernetes-models (its validators use it).
  const kmDir = path.dirname(require.resolve("kubernetes-models/package.json"));
  const Ajv = require(require.resolve("ajv", {paths: [kmDir]}));
  const ajv = new Ajv({strict: false, allErrors: true, validateFormats: false});
  crdValidate = ajv.compile(strictSchema(version.schema.openAPIV3Schema));
}

const objects = JSON.parse(fs.readFileSync(objectsFile, "utf8"));
let bad = 0;
for (const {file, object: o} of objects) {
  const what = `${file}: ${o.kind} ${(o.metadata && (o.metadata.name || o.metadata.generateName)) || "?"}`;
  try {
    if (o.apiVersion === "kubeflow.org/v2beta1" && o.kind === "MPIJob") {
      const specs = (o.spec && o.spec.mpiReplicaSpecs) || {};
      for (const [type, rs] of Object.entries(specs)) {
        try {
          modelValidate("v1", "PodTemplate", {metadata: {name: type.toLowerCase()}, template: rs.template});
        } catch (e) {
          throw new Error(`mpiReplicaSpecs.${type}.template: ${e.message}`);
        }
      }
      if (crdValidate) {
        if (!crdValidate(o)) {
          throw new Error("CRD schema: " + crdValidate.errors.map(
              (e) => `${e.instancePath || "/"} ${e.message}` +
                     (e.params && e.params.additionalProperty ? ` (${e.params.additionalProperty})` : "")).join("; "));
        }
        console.log(`ok   ${what} (pod templates: core/v1 schema; object: the MPIJob CRD's schema)`);
      } else {
        console.log(`ok   ${what} (pod templates: core/v1 schema; no CRD schema given)`);
      }
    } else {
      modelValidate(o.apiVersion, o.kind, o);
      console.log(`ok   ${what} (${modules[o.apiVersion]})`);
    }
  } catch (e) {
    bad++;
    console.log(`FAIL ${what}: ${e.message}`);
  }
}
process.exit(bad ? 1 : 0);
