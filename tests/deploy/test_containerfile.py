"""The image installs what ``make install`` installs, minus the test tools: the wheels
``make wheels`` builds from this project (its runtime dependencies, no extras), offline, with
the same protobuf-module fix-up; from a base pinned by digest, into a final stage without
build tools, as non-root.

Both files are parsed: the Makefile's recipes and the Containerfile's stages. tests/image
builds the image and runs it."""

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


def _make_variables(text: str) -> dict[str, str]:
    return dict(re.findall(r"^(\w+) :?= (.*)$", text, re.MULTILINE))


def make_recipe(target: str) -> tuple[str, str]:
    """A Makefile rule's prerequisites and recipe, with its ``$(NAME)`` variables expanded."""
    text = MAKEFILE.read_text()
    variables = _make_variables(text)

    def expand(s: str) -> str:
        while (new := re.sub(r"\$\((\w+)\)", lambda m: variables.get(m[1], m[0]), s)) != s:
            s = new
        return s

    for match in re.finditer(r"^(\S+):(.*)\n((?:\t.*\n)+)", text, re.MULTILINE):
        if expand(match[1]) == target:
            return expand(match[2]), expand(match[3].replace("\\\n", " "))
    raise AssertionError(f"no {target} target in the Makefile")


def _pip_wheel(recipe: str) -> list[str]:
    (line,) = [line for line in recipe.splitlines() if " wheel " in line]
    return shlex.split(line)


def test_the_image_installs_the_wheels_of_the_project_without_the_test_tools() -> None:
    name = _pyproject()["project"]["name"]
    # the runtime dependencies: this directory's project, no extras (the test tools are an
    # extra), resolved again when pyproject.toml changes; the project's own wheel left out
    prerequisites, recipe = make_recipe("build/wheels/deps/.complete")
    assert "pyproject.toml" in prerequisites.split()
    deps = _pip_wheel(recipe)
    assert "." in deps
    assert not any(w.startswith(".[") for w in deps)
    assert deps[deps.index("--wheel-dir") + 1] == "build/wheels/deps"
    assert f"rm -f build/wheels/deps/{name}-*.whl" in recipe
    # the project's own wheel, every time
    prerequisites, recipe = make_recipe("wheels")
    assert "build/wheels/deps/.complete" in prerequisites.split()
    project = _pip_wheel(recipe)
    assert project[-1] == "."
    assert "--no-deps" in project
    assert project[project.index("--wheel-dir") + 1] == "build/wheels/project"

    _, stages = parse_containerfile(CONTAINERFILE.read_text())
    build = stages[0]
    # the dependencies in one layer, the project in the next
    assert [name for name, _ in build.instructions] == ["ENV", "COPY", "RUN", "COPY", "RUN"]
    assert build.commands("COPY") == [
        "build/wheels/deps /wheels/deps",
        "build/wheels/project /wheels/project",
    ]
    deps_run, project_run = ([s.strip() for s in run.split("&&")] for run in build.commands("RUN"))
    # the wheels only: no index, so no network during the build
    assert deps_run[0] == "python3 -m venv /opt/epp"
    assert deps_run[1] == "/opt/epp/bin/python -m pip install --no-index /wheels/deps/*.whl"
    # the protobuf-module fix-up make install applies after everything, applied last too
    make_fixups = reinstalls(make_install_recipe())
    assert make_fixups, "the Makefile's reinstall of opentelemetry-proto was not recognised"
    assert "--force-reinstall" in deps_run[-1]
    offline = deps_run[-1].replace("--no-index --find-links /wheels/deps ", "")
    assert reinstalls(offline) == make_fixups, (deps_run[-1], make_fixups)
    # the project on them, reinstalling none of them, the set consistent
    assert project_run[0] == (
        "/opt/epp/bin/python -m pip install --no-index "
        f"--find-links /wheels/deps --find-links /wheels/project {name}"
    )
    assert project_run[1] == "/opt/epp/bin/python -m pip check"
    # no pip left in the virtualenv, and the installed EPP starts far enough to say its version
    assert project_run[-2] == "/opt/epp/bin/python -m pip uninstall --yes pip"
    assert project_run[-1] == "/opt/epp/bin/epp --version"


def test_the_build_context_is_the_wheels_only() -> None:
    _, stages = parse_containerfile(CONTAINERFILE.read_text())
    assert all(c.startswith("build/wheels/") for c in stages[0].commands("COPY"))
    allowed = [
        line for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1] in "*!"
    ]
    assert allowed == ["*", "!build/wheels/"]


def test_the_final_stage_is_the_pinned_base_and_the_virtualenv_only() -> None:
    args, stages = parse_containerfile(CONTAINERFILE.read_text())
    assert len(stages) == 2
    build, final = stages
    assert re.search(r"@sha256:[0-9a-f]{64}$", args["BASE_IMAGE"]), args
    assert final.base == build.base == args["BASE_IMAGE"]
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
    assert entrypoint == '["/opt/epp/bin/epp"]'
    assert "epp" in _pyproject()["project"]["scripts"]


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
    recipe = re.search(r"^image:.*\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert recipe, "no `image` target"
    body = recipe[1]
    assert "-f Containerfile" in body
    assert "--isolation chroot" in body  # podman, where no container can be run
    assert "no podman, docker or buildah" in body
    assert Path(CONTAINERFILE).name == "Containerfile"
