"""The image installs what ``make install`` installs, minus the test tools: the wheel built
from this project's pyproject.toml, its runtime dependencies, and the same protobuf-module
fix-up; from a base pinned by digest, into a final stage without build tools, as non-root.

Both files are parsed: the Makefile's ``$(STAMP)`` recipe and the Containerfile's stages."""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.manifests import ROOT

CONTAINERFILE = ROOT / "Containerfile"
MAKEFILE = ROOT / "Makefile"
#: make install's extras that are development tools, not part of the EPP.
DEVELOPMENT_EXTRAS = {"test"}


@dataclass
class Stage:
    base: str
    name: str = ""
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def commands(self, instruction: str) -> list[str]:
        return [args for name, args in self.instructions if name == instruction]


def _logical_lines(text: str) -> list[str]:
    """Instructions with continuations joined and comment lines dropped."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        lines.append(current + stripped)
        current = ""
    return [line for line in lines if line]


def parse_containerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif instruction == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], words[0])
            stages.append(Stage(base=base, name=words[2] if len(words) == 3 else ""))
        else:
            stages[-1].instructions.append((instruction, rest))
    return args, stages


#: ``pip install [options] "name==$(python -c '...')"``: a reinstall at the installed version.
_REINSTALL = re.compile(
    r"pip (?:--python \S+ )?install (?P<options>(?:--[\w-]+ +)*)"
    r"\"(?P<name>[\w-]+)==\$\$?\((?P<python>\S+) -c '(?P<code>[^']*)'\)\""
)
#: Options that change how pip talks, not what it installs.
_QUIET = {"--quiet", "--disable-pip-version-check"}


def reinstalls(text: str) -> list[tuple[frozenset[str], str, str]]:
    """(options, distribution, version lookup) of every reinstall-at-installed-version."""
    return [
        (frozenset(m["options"].split()) - _QUIET, m["name"], m["code"])
        for m in _REINSTALL.finditer(re.sub(r"\s+", " ", text))
    ]


def make_install_recipe() -> str:
    text = MAKEFILE.read_text()
    match = re.search(r"^\$\(STAMP\):.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert match, "no $(STAMP) recipe in the Makefile"
    return match[1].replace("\\\n", " ")


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_image_installs_the_wheel_make_install_builds_without_the_test_tools() -> None:
    # make install: this directory's project (editable), with extras
    recipe = make_install_recipe()
    (project_line,) = [line for line in recipe.splitlines() if " -e " in line]
    words = shlex.split(project_line.partition("$(foreach")[0])
    (spec,) = [w for w in words if w == "." or w.startswith(".[")]
    make_extras = set(re.findall(r"[\w-]+", spec.partition("[")[2]))
    project = _pyproject()["project"]
    assert make_extras <= set(project["optional-dependencies"])

    _, stages = parse_containerfile(CONTAINERFILE.read_text())
    (run,) = stages[0].commands("RUN")
    steps = [s.strip() for s in run.split("&&")]
    # the wheel of this directory's pyproject.toml (the same build backend), then that wheel
    # with make install's extras minus the development tools (none today)
    assert steps[0] == "python -m pip wheel --no-deps --wheel-dir /wheels ."
    wheel = f"/wheels/{project['name']}-*.whl{_extras(make_extras - DEVELOPMENT_EXTRAS)}"
    assert f"python -m pip --python /opt/epp/bin/python install {wheel}" in steps
    # the protobuf-module fix-up make install applies after everything, applied last too
    make_fixups = reinstalls(recipe)
    assert make_fixups, "the Makefile's reinstall of opentelemetry-proto was not recognised"
    assert reinstalls(steps[-2]) == make_fixups, (steps[-2], make_fixups)
    # and the image's own check that the installed EPP starts far enough to print its flags
    assert steps[-1] == "/opt/epp/bin/python -m app --help >/dev/null"


def _extras(extras: set[str]) -> str:
    return f"[{','.join(sorted(extras))}]" if extras else ""


def test_the_build_context_holds_the_packages_the_wheel_is_built_from() -> None:
    _, stages = parse_containerfile(CONTAINERFILE.read_text())
    sources = {
        word
        for args in stages[0].commands("COPY")
        for word in args.split()[:-1]
        if not word.startswith("--")
    }
    packages = set(_pyproject()["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"])
    assert sources == packages | {"pyproject.toml", "README.md"}
    # and .dockerignore lets exactly those into the context
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert allowed == sources


def test_the_final_stage_is_the_pinned_base_and_the_virtualenv_only() -> None:
    _, stages = parse_containerfile(CONTAINERFILE.read_text())
    assert len(stages) == 2
    build, final = stages
    assert re.search(r"@sha256:[0-9a-f]{64}$", final.base), final.base
    assert final.base == build.base
    names = [name for name, _ in final.instructions]
    assert "RUN" not in names, "the final stage runs nothing: no package manager, no compiler"
    assert final.commands("COPY") == [f"--from={build.name} /opt/epp /opt/epp"]
    (user,) = final.commands("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit()
    assert gid.isdigit()
    assert int(uid) != 0
    assert int(gid) != 0
    (entrypoint,) = final.commands("ENTRYPOINT")
    assert entrypoint == '["epp"]'
    assert "epp" in _pyproject()["project"]["scripts"]
    # the virtualenv has no pip to install anything with at run time
    (run,) = build.commands("RUN")
    assert "venv --without-pip /opt/epp" in run


def test_the_manifests_run_the_image_as_its_user(overlays: dict[str, list[object]]) -> None:
    _, stages = parse_containerfile(CONTAINERFILE.read_text())
    (user,) = stages[-1].commands("USER")
    for objects in overlays.values():
        for obj in objects:
            assert isinstance(obj, dict)
            if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "my-pool-epp":
                context = obj["spec"]["template"]["spec"]["securityContext"]
                assert f"{context['runAsUser']}:{context['runAsGroup']}" == user


def test_the_make_image_target_builds_this_file_or_says_why_not() -> None:
    text = MAKEFILE.read_text()
    recipe = re.search(r"^image:\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert recipe, "no `image` target"
    body = recipe[1]
    assert "-f Containerfile" in body
    assert "no podman, docker or buildah" in body
    assert Path(CONTAINERFILE).name == "Containerfile"
