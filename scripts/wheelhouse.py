"""The offline bundle (scripts/wheelhouse.sh builds it, scripts/gpu_check.sh --offline uses it).

``build``: on a machine with a package index, binary wheels of moment and of what it needs at run
time, for one Python and manylinux x86-64, torch excepted (the GPU server has its own), and
kvikio for one CUDA major; ``manifest.json`` lists each package once (name, version, file,
sha256, why, requires). pip resolves the whole tree (one version of each package, every bound
honoured); the bundle then keeps only what moment imports: :data:`PRUNED` names the
requirements that are declared but never imported by moment's use of a package, and why.

``select``: on the server, with only the standard library (and ``packaging``, taken from the
bundle's own wheel where the interpreter lacks it), the wheels the interpreter cannot already
import at a version that satisfies what needs it; gpu_check.sh installs those, ``--no-index
--no-deps --target``, into a scratch folder. ``torch``: one line and exit 1 for a torch older
than moment's bound (or without CUDA, unless asked for a CPU self-test).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = "moment.wheelhouse/1"
# The manylinux tags the bundle accepts, newest first: glibc 2.28 (RHEL 8, Ubuntu 20.04) and older.
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_12_x86_64",
    "manylinux2010_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
]
# Requirements declared but not imported where moment uses the package (checked with an import
# blocker: the planner's LPs and max flow, PyG's layers and store/sampler interfaces, kvikio's
# CuFile and defaults on torch tensors). (requirer, required) → why it is left out.
PRUNED = {
    ("moment", "torch"): "the server's own torch is used",
    ("ortools", "pandas"): "pywraplp and max_flow import neither pandas",
    ("ortools", "protobuf"): "nor protobuf",
    ("ortools", "absl-py"): "nor absl",
    ("ortools", "immutabledict"): "nor immutabledict",
    ("torch-geometric", "aiohttp"): "only PyG's remote backends import aiohttp",
    ("torch-geometric", "pyparsing"): "not imported by PyG's layers or store interfaces",
    (
        "kvikio-cu12",
        "cupy-cuda12x",
    ): "moment hands kvikio torch tensors; kvikio imports cupy only in its benchmarks/codecs",
    (
        "kvikio-cu13",
        "cupy-cuda13x",
    ): "moment hands kvikio torch tensors; kvikio imports cupy only in its benchmarks/codecs",
}


def norm(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def target_env(python: str) -> dict[str, str]:
    """Marker values of a CPython ``python`` (X.Y) on Linux x86-64."""
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist) of a wheel file."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        msg = Parser().parsestr(z.read(meta).decode())
    return msg["Name"], msg["Version"], msg.get_all("Requires-Dist") or []


def pip(python: str, *args: str) -> None:
    """Run pip of ``python``; its failure is this script's (exit 1, pip's message above)."""
    cmd = [python, "-m", "pip", "--disable-pip-version-check", *args]
    done = subprocess.run(cmd, check=False)
    if done.returncode != 0:
        sys.exit(f"wheelhouse: pip failed ({done.returncode}): {' '.join(cmd)}")


def platform_args(python: str) -> list[str]:
    out = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for p in PLATFORMS:
        out += ["--platform", p]
    return out


def build(args: argparse.Namespace) -> int:
    _packaging(None)
    from packaging.requirements import Requirement

    dest = Path(args.dir)
    moment_whl = Path(args.moment_wheel)
    name, version, requires = wheel_metadata(moment_whl)
    skip = {norm(s) for s in args.skip.split(",") if s.strip()}
    env = target_env(args.python)
    extras = [] if args.no_pulp else ["pulp"]
    extras += ["udev"]
    roots = [r for r in requires if _applies(Requirement(r), env, extras)]
    root_reqs = [str(_bare(r)) for r in roots if norm(Requirement(r).name) not in {"torch", *skip}]
    kvikio = [] if args.no_kvikio else [f"kvikio-cu{args.cuda}"]
    # gpu_check's gpu tests: pytest at the test extra's bound (a site's PyTorch rarely has it).
    tests = [str(_bare(r)) for r in requires if norm(Requirement(r).name) == "pytest"]
    with tempfile.TemporaryDirectory(prefix="moment-wheelhouse-") as tmp:
        report = Path(tmp) / "report.json"
        # The resolution only (metadata, no wheels): every bound of the whole tree at once.
        pip(
            args.python_exe,
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--target",
            str(Path(tmp) / "t"),
            *platform_args(args.python),
            *root_reqs,
            *kvikio,
            *tests,
            "packaging",
        )
        resolved = {
            norm(item["metadata"]["name"]): item["metadata"] for item in json.loads(report.read_text())["install"]
        }
    # Walk from moment's requirements through what each needs, as resolved, leaving out PRUNED
    # edges and --skip names; "why" is the first requirer's line.
    keep: dict[str, dict] = {}
    queue: list[tuple[str, str, list[str]]] = [("moment", r, extras) for r in roots]
    queue += [("kvikio extra", r, []) for r in kvikio] + [("the check's version comparisons", "packaging", [])]
    queue += [("gpu_check's gpu tests", r, []) for r in tests]
    while queue:
        requirer, line, req_extras = queue.pop(0)
        req = Requirement(line)
        key = norm(req.name)
        if not _applies(req, env, req_extras) or key in skip or (norm(requirer), key) in PRUNED:
            continue
        if key not in resolved:
            sys.exit(f"wheelhouse: {requirer} needs {line}, which pip did not resolve")
        meta = resolved[key]
        entry = keep.setdefault(key, {"name": meta["name"], "version": meta["version"], "why": [], "requires": []})
        entry["why"].append(f"{requirer}: {_bare(line)}")
        if len(entry["why"]) > 1 and set(req.extras) <= set(entry.get("extras", [])):
            continue
        entry["extras"] = sorted(set(entry.get("extras", [])) | set(req.extras))
        for sub in meta.get("requires_dist", []):
            sub_req = Requirement(sub)
            if _applies(sub_req, env, list(req.extras)) and (key, norm(sub_req.name)) not in PRUNED:
                if norm(sub_req.name) not in skip:
                    entry["requires"].append(str(_bare(sub)))
                queue.append((meta["name"], sub, list(req.extras)))
    dest.mkdir(parents=True, exist_ok=True)
    pip(
        args.python_exe,
        "download",
        "--quiet",
        "--no-deps",
        "-d",
        str(dest),
        *platform_args(args.python),
        *[f"{e['name']}=={e['version']}" for e in keep.values()],
    )
    target = dest / moment_whl.name
    if moment_whl.resolve() != target.resolve():
        target.write_bytes(moment_whl.read_bytes())
    files = {norm(wheel_metadata(p)[0]): p for p in sorted(dest.glob("*.whl"))}
    stray = [p.name for k, p in files.items() if k != norm(name) and k not in keep]
    if stray:
        sys.exit(f"wheelhouse: {dest} holds wheels that are not in this bundle: {', '.join(stray)} (use an empty DIR)")
    packages = [
        {
            "name": name,
            "version": version,
            "file": target.name,
            "sha256": sha256(target),
            "bytes": target.stat().st_size,
            "why": ["this repository, built as a wheel"],
            "requires": [str(_bare(r)) for r in roots],
        }
    ]
    for key, e in sorted(keep.items()):
        if key not in files:
            sys.exit(f"wheelhouse: pip downloaded no wheel of {e['name']} {e['version']}")
        f = files[key]
        got = wheel_metadata(f)[1]
        if got != e["version"]:
            sys.exit(f"wheelhouse: {f.name} is {e['name']} {got}, not the resolved {e['version']} (use an empty DIR)")
        packages.append(
            {
                "name": e["name"],
                "version": e["version"],
                "file": f.name,
                "sha256": sha256(f),
                "bytes": f.stat().st_size,
                "why": e["why"],
                "requires": sorted(set(e["requires"])),
            }
        )
    doc = {
        "format": FORMAT,
        "python": args.python,
        "cuda": None if args.no_kvikio else args.cuda,
        "platforms": PLATFORMS,
        "skipped": sorted(skip),
        # what the check needs, the walk's start: moment's requirements, kvikio, pytest, packaging
        "roots": [str(_bare(r)) for r in roots] + kvikio + tests + ["packaging"],
        "pruned": [f"{a} → {b}: {why}" for (a, b), why in PRUNED.items()],
        "packages": packages,
        "total_bytes": sum(p["bytes"] for p in packages),
    }
    (dest / MANIFEST).write_text(json.dumps(doc, indent=2) + "\n")
    for p in sorted(packages, key=lambda p: -p["bytes"]):
        print(f"{p['bytes'] / 2**20:8.2f} MiB  {p['name']} {p['version']}  ({p['why'][0]})")
    print(f"{doc['total_bytes'] / 2**20:8.2f} MiB in {len(packages)} wheels: {dest / MANIFEST}")
    return 0


def _bare(line: str) -> object:
    """The requirement without its marker (already evaluated for the target)."""
    from packaging.requirements import Requirement

    req = Requirement(line)
    req.marker = None
    return req


def _applies(req: object, env: dict[str, str], extras: list[str]) -> bool:
    """The requirement's marker holds on the target for one of ``extras`` (or none)."""
    marker = req.marker  # type: ignore[attr-defined]
    if marker is None:
        return True
    return any(marker.evaluate({**env, "extra": x}) for x in [*extras, ""])


def _packaging(bundle: Path | None) -> None:
    """Make ``packaging`` importable: the interpreter's, pip's copy, or the bundle's wheel."""
    try:
        import packaging.requirements  # noqa: F401
    except ImportError:
        try:
            from pip._vendor import packaging
            from pip._vendor.packaging import requirements, specifiers, version

            sys.modules.update(
                {
                    "packaging": packaging,
                    "packaging.requirements": requirements,
                    "packaging.specifiers": specifiers,
                    "packaging.version": version,
                }
            )
            return
        except ImportError:
            pass
        wheels = sorted(bundle.glob("packaging-*.whl")) if bundle else []
        if not wheels:
            sys.exit(f"gpu_check: {bundle} has no packaging wheel and {sys.executable} has no packaging")
        sys.path.insert(0, str(wheels[-1]))  # a pure wheel is importable as a zip


def load_manifest(bundle: Path) -> dict:
    path = bundle / MANIFEST
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        sys.exit(f"gpu_check: {path}: {exc} (build the bundle with scripts/wheelhouse.sh)")
    if doc.get("format") != FORMAT:
        sys.exit(f"gpu_check: {path}: format {doc.get('format')!r}, not {FORMAT}")
    return doc


def select(args: argparse.Namespace) -> int:
    """Print the bundle's wheel files to install, one a line; the decisions go to stderr."""
    from importlib import metadata

    bundle = Path(args.dir)
    doc = load_manifest(bundle)
    _packaging(bundle)
    from packaging.requirements import Requirement
    from packaging.version import Version

    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    if doc["python"] != mine:
        sys.exit(f"gpu_check: {bundle} was built for Python {doc['python']}, this interpreter is {mine}")
    by_name = {norm(p["name"]): p for p in doc["packages"]}
    del by_name["moment"]  # the checkout is on PYTHONPATH: its code is what is checked
    installed: dict[str, str] = {}
    for dist in metadata.distributions():
        installed.setdefault(norm(dist.metadata["Name"] or ""), dist.version)
    # Fixed point: a package comes from the bundle when the interpreter lacks it or has a version
    # some requirement of moment's or of a bundled package refuses.
    specs: dict[str, list[Requirement]] = {}
    chosen: set[str] = set()
    changed = True
    while changed:
        changed = False
        specs = {}
        for line in doc["roots"] + [r for k in chosen for r in by_name[k]["requires"]]:
            req = Requirement(line)
            specs.setdefault(norm(req.name), []).append(req)
        for key, reqs in specs.items():
            if key not in by_name or key in chosen:
                continue
            have = installed.get(key)
            if have is None or not all(r.specifier.contains(Version(have), prereleases=True) for r in reqs):
                chosen.add(key)
                changed = True
    # What the bundle left out (--skip: "the server has it") must be here, at a version allowed.
    skipped = {norm(n) for n in doc.get("skipped", [])}
    for key in sorted(set(specs) - set(by_name)):
        have, reqs = installed.get(key), specs[key]
        if key in skipped and (
            have is None or not all(r.specifier.contains(Version(have), prereleases=True) for r in reqs)
        ):
            need = ", ".join(sorted({str(r) for r in reqs}))
            sys.exit(
                f"gpu_check: {sys.executable} {'lacks ' + key if have is None else f'has {key} {have}'} "
                f"(moment needs {need}), which {bundle} left out (--skip): build it again without skipping {key}"
            )
        if have is not None and key in skipped:
            print(f"keep    {key} {have} (left out of the bundle)", file=sys.stderr)
    for key in sorted(set(specs) & set(by_name)):
        p, have = by_name[key], installed.get(key)
        if key in chosen:
            print(f"install {p['name']} {p['version']}" + (f" (has {have})" if have else ""), file=sys.stderr)
            print(bundle / p["file"])
        else:
            print(f"keep    {p['name']} {have}", file=sys.stderr)
    return 0


def torch_check(args: argparse.Namespace) -> int:
    """Exit 1 with one line when torch is missing, older than moment's bound, or (unless --cpu)
    cannot see a CUDA device; print its version otherwise."""
    bound = args.bound
    if args.dir:
        bundle = Path(args.dir)
        _packaging(bundle)
        moment = next(p for p in load_manifest(bundle)["packages"] if p["name"] == "moment")
        bound = next((r for r in moment["requires"] if norm(re.split(r"[<>=!~ ;\[]", r)[0]) == "torch"), bound)
    try:
        import torch
    except ImportError as exc:
        sys.exit(f"gpu_check: {sys.executable} cannot import torch ({exc}): use the Python of the site's PyTorch")
    from packaging.requirements import Requirement
    from packaging.version import Version

    have = Version(torch.__version__.split("+")[0])
    req = Requirement(bound)
    if not req.specifier.contains(have, prereleases=True):
        sys.exit(f"gpu_check: torch {torch.__version__} is not supported (moment needs {bound})")
    if not args.cpu and not torch.cuda.is_available():
        sys.exit(
            f"gpu_check: torch {torch.__version__} of {sys.executable} sees no CUDA device (CUDA {torch.version.cuda})"
        )
    print(torch.__version__)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="resolve, download, write the manifest")
    b.add_argument("dir")
    b.add_argument("--moment-wheel", required=True)
    b.add_argument("--python", required=True, help="target CPython, X.Y")
    b.add_argument("--cuda", choices=["12", "13"], default="13")
    b.add_argument("--skip", default="", help="names to leave out (the target has them)")
    b.add_argument("--no-pulp", action="store_true")
    b.add_argument("--no-kvikio", action="store_true")
    b.add_argument("--python-exe", default=sys.executable, help="the interpreter whose pip resolves and downloads")
    s = sub.add_parser("select", help="the wheels this interpreter needs from the bundle")
    s.add_argument("dir")
    t = sub.add_parser("torch", help="check this interpreter's torch")
    t.add_argument("--dir", help="bundle: moment's torch bound from its manifest")
    t.add_argument("--bound", default="torch", help="without --dir: the bound to check")
    t.add_argument("--cpu", action="store_true", help="a CPU torch is fine (self-test)")
    args = ap.parse_args()
    if args.cmd == "build" and not re.fullmatch(r"3\.\d+", args.python):
        ap.error(f"--python must be X.Y, not {args.python}")
    return {"build": build, "select": select, "torch": torch_check}[args.cmd](args)


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
