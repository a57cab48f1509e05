"""deploy/rpm/neuron.spec: scripts/build-srpm builds the source RPM and rpmlint finds no error.

Needs rpmbuild and rpmlint (Debian: `apt-get install rpm rpmlint`; .ci/run installs both).
Outside CI a machine without them skips; under CI=true their absence fails, so a CI image that
lost them cannot pass quietly.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "deploy" / "rpm" / "neuron.spec"


def _require(tool: str) -> None:
    if shutil.which(tool) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{tool} is missing under CI (apt-get install rpm rpmlint)")
        pytest.skip(f"{tool} is not installed (Debian: apt-get install rpm rpmlint)")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    for tool in ("rpmbuild", "rpmlint", "git"):
        _require(tool)
    out = tmp_path_factory.mktemp("srpm")
    run = subprocess.run(
        [str(REPO / "scripts" / "build-srpm"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    srpms = list(out.glob("neuron-*.src.rpm"))
    assert len(srpms) == 1, report
    return srpms[0], report


def test_srpm_builds_and_rpmlint_reports_no_error(built: tuple[Path, str]) -> None:
    _, report = built
    summary = re.search(r"(\d+) errors?, (\d+) warnings?", report)
    assert summary is not None, report
    assert summary.group(1) == "0", report


def test_srpm_carries_the_sources_and_the_build_requirements(built: tuple[Path, str]) -> None:
    srpm, _ = built
    files = subprocess.run(
        ["rpm", "-qpl", str(srpm)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert sorted(files) == ["neuron-0.1.0.tar.gz", "neuron.spec", "neuron.sysusers.conf"]
    requires = subprocess.run(
        ["rpm", "-qp", "--requires", str(srpm)], capture_output=True, text=True, check=True
    ).stdout
    for needed in ("python3-devel", "pyproject-rpm-macros", "systemd-rpm-macros"):
        assert needed in requires


def test_the_tarball_holds_what_the_spec_installs(built: tuple[Path, str], tmp_path: Path) -> None:
    srpm, _ = built
    subprocess.run(f"rpm2cpio {srpm} | cpio -idm --quiet", shell=True, check=True, cwd=tmp_path)
    listing = subprocess.run(
        ["tar", "-tzf", str(tmp_path / "neuron-0.1.0.tar.gz")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for path in ("pyproject.toml", "deploy/neuron.service", "deploy/neuron.toml", "README.md"):
        assert f"neuron-0.1.0/{path}" in listing


def test_spec_uses_the_packaging_macros_it_promises() -> None:
    text = SPEC.read_text()
    for macro in (
        "%pyproject_wheel",
        "%pyproject_install",
        "%pyproject_buildrequires",
        "%systemd_post neuron.service",
        "%systemd_preun neuron.service",
        "%systemd_postun_with_restart neuron.service",
        "%sysusers_create_compat %{SOURCE1}",
        "%config(noreplace) %attr(0640,root,neuron) %{_sysconfdir}/neuron/neuron.toml",
        "%dir %attr(0700,neuron,neuron) %{_sharedstatedir}/neuron",
    ):
        assert macro in text, macro
    version = re.search(r"^Version:\s+(\S+)", text, re.M)
    pyproject = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M)
    assert version is not None and pyproject is not None
    assert version.group(1) == pyproject.group(1)
