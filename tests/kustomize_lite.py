"""Render a kustomization in Python: the subset of kustomize that deploy/k8s uses.

Supported: `resources` (files and directories holding a kustomization), `images` (name, newName,
newTag, digest) and `patches` given as RFC 6902 JSON patches (inline `patch` or `path`) with a
`target` of kind/name. Any other key is an error, never ignored, so an overlay that starts using
a feature this does not implement fails the test instead of rendering wrongly. When a real
kustomize (`kubectl kustomize`) is on the machine, the tests check this renderer against it.
"""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "images", "patches"}


def render(directory: str | Path) -> list[dict]:
    d = Path(directory)
    k = yaml.safe_load((d / "kustomization.yaml").read_text())
    unknown = set(k) - KNOWN_KEYS
    if unknown:
        raise ValueError(f"{d}/kustomization.yaml: unsupported keys {sorted(unknown)}")
    objects: list[dict] = []
    for res in k.get("resources", []):
        p = (d / res).resolve()
        if p.is_dir():
            objects += render(p)
        else:
            objects += [o for o in yaml.safe_load_all(p.read_text()) if o]
    for img in k.get("images", []):
        for o in objects:
            for c in _containers(o):
                if _image_name(c["image"]) == img["name"]:
                    c["image"] = _new_image(c["image"], img)
    for patch in k.get("patches", []):
        ops = yaml.safe_load(patch["patch"] if "patch" in patch else (d / patch["path"]).read_text())
        target = patch["target"]
        hits = [o for o in objects if o.get("kind") == target.get("kind", o.get("kind"))
                and o["metadata"]["name"] == target.get("name", o["metadata"]["name"])]
        if not hits:
            raise ValueError(f"{d}: patch target {target} matches nothing")
        for o in hits:
            apply_json_patch(o, ops)
    return objects


def _containers(o: dict) -> list[dict]:
    spec = o.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def _image_name(image: str) -> str:
    name = image.split("@")[0]
    last = name.rsplit("/", 1)[-1]
    return name[: len(name) - len(last)] + last.split(":")[0]


def _new_image(image: str, img: dict) -> str:
    name = img.get("newName", _image_name(image))
    if "digest" in img:
        return f"{name}@{img['digest']}"
    tag = img.get("newTag")
    if tag is None and ":" in image.rsplit("/", 1)[-1]:
        tag = image.rsplit(":", 1)[1]
    return f"{name}:{tag}" if tag else name


def _walk(doc, pointer: str):
    parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
    parent = doc
    for p in parts[:-1]:
        parent = parent[int(p)] if isinstance(parent, list) else parent[p]
    return parent, parts[-1]


def apply_json_patch(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        parent, key = _walk(doc, op["path"])
        kind = op["op"]
        if kind not in ("add", "replace", "remove"):
            raise ValueError(f"JSON patch op {kind!r} is not supported here")
        if isinstance(parent, list):
            if kind == "add":
                parent.insert(len(parent) if key == "-" else int(key), copy.deepcopy(op["value"]))
            elif kind == "replace":
                parent[int(key)] = copy.deepcopy(op["value"])
            else:
                del parent[int(key)]
        else:
            if kind == "replace" and key not in parent:
                raise ValueError(f"replace of a missing path {op['path']}")
            if kind == "remove":
                del parent[key]
            else:
                parent[key] = copy.deepcopy(op["value"])
