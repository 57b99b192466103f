"""The docs site: the generated references are complete, every TOML example validates, every tutorial
command runs, the example algorithm learns, and the built site renders in a browser."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from examples.normclip import NormClip
from fedtier import docs_reference as ref
from protocols.config import ConfigError, RunConfig, parse_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
TUTORIALS = sorted((DOCS / "tutorials").glob("*.md"))
# what the tutorials' fedtier sim/run commands get appended in the test, so that each takes seconds
SMALL = (
    "--set run.rounds=2 --set algorithm.edge_rounds=1 --set algorithm.local_steps=5 --set data.max_train=2000 "
    "--set data.max_test=500"
)


@dataclass
class Block:
    """A fenced code block of a page, with the ``<!-- docs-test: ... -->`` line above it, if any."""

    page: Path
    line: int
    lang: str
    text: str
    mark: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)", lines[i])
        if m is None:
            i += 1
            continue
        above = lines[i - 1] if i else ""
        mark = re.match(r"^<!-- docs-test: (.*) -->$", above)
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        out.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1 : end]) + "\n", mark.group(1) if mark else ""))
        i = end + 1
    return out


# ------------------------------------------------------------------------------------ references


def test_every_config_field_has_a_description() -> None:
    assert ref.missing_descriptions() == [], "add Field(description=...) to these config fields"


def test_a_field_without_description_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic.fields import FieldInfo

    from protocols.config import RunSection

    fields = dict(RunSection.model_fields)
    fields["bare"] = FieldInfo(annotation=int, default=0)
    monkeypatch.setattr(RunSection, "model_fields", fields)
    assert ref.missing_descriptions() == ["run.bare"]


def test_config_reference_lists_every_key_with_type_default_and_constraint() -> None:
    text = ref.config_reference()
    for section, field in RunConfig.model_fields.items():
        if section == "algorithm":
            continue
        assert f"## `[{section}]`" in text
        for key in field.annotation.model_fields:  # type: ignore[union-attr]
            assert f"| `{key}` |" in text, f"{section}.{key}"
    assert "| `seed` | int | `0` | ≥ 0 | the run seed" in text
    assert "| `prox_mu` | float | `0.0` | ≥ 0 |" in text  # an algorithm key (FedAvgParams)
    # DeComFL overrides TrainParams' local_steps: its own group shows its own default
    decomfl = text.split("### DeComFLParams (`decomfl`)")[1].split("###")[0]
    assert "| `local_steps` | int | `1` | ≥ 1 | K:" in decomfl


def test_cli_reference_has_every_command_and_option() -> None:
    import click

    from fedtier.cli import main

    text = ref.cli_reference()
    commands = {name: cmd for name, cmd in main.commands.items()}
    for name, cmd in main.commands.items():
        commands.update({f"{name} {w}": sub for w, sub in getattr(cmd, "subcommands", {}).items()})
        if isinstance(cmd, click.Group):  # fedtier provision create|renew|add-device|add-cell|revoke
            commands.update({f"{name} {w}": sub for w, sub in cmd.commands.items()})
    assert "provision renew" in commands
    for name, cmd in commands.items():
        assert f"## `fedtier {name}`" in text
        for param in cmd.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("-"):
                    assert f"`{opt}`" in text, f"fedtier {name} {opt}"
    # every click command the CLI modules define is reachable (so it is in the reference), none hidden
    reachable = {id(c) for c in commands.values()}
    for module in sorted((ROOT / "fedtier").glob("cmd_*.py")):
        mod = __import__(f"fedtier.{module.stem}", fromlist=["_"])
        for value in vars(mod).values():
            if isinstance(value, click.Command) and not isinstance(value, click.Group):
                assert id(value) in reachable, f"{module.name}: command {value.name!r} is not reachable from fedtier"


def test_metrics_reference_has_every_exported_metric() -> None:
    from prometheus_client import generate_latest

    from monitor.exporter import MetricsExporter

    exporter = MetricsExporter("r")
    exporter.observe(
        {"event": "round", "run": "r", "round": 0, "rounds": 2, "closed_by": "all", "duration_s": 0.1, "schema": 1}
    )
    exported = set(re.findall(r"^# TYPE (\S+) ", generate_latest(exporter.registry).decode(), re.M))
    text = ref.metrics_reference()
    for name in exported - {n for n in exported if n.endswith("_created")}:  # (serve() turns these off)
        assert f"`{name}" in text, name
    assert "| `fedtier_agent_tasks_total` | counter | `run` |" in text


def test_topic_map_and_wire_page_cover_every_topic_and_message_kind() -> None:
    text = ref.topics_reference()
    assert "| `device_result` | `fedtier/{run}/cell/{cell}/up/{device}/result` | device_to_cell |" in text
    assert "| `telemetry_cell` | `fedtier/{run}/telemetry/cell/{cell}` |  | {cell} |" in text
    wire = (DOCS / "reference" / "wire.md").read_text(encoding="utf-8")
    for kind in ref.wire_kinds():
        assert f"`{kind}`" in wire, f"message kind {kind} is not described in docs/reference/wire.md"
    header = ref.wire_header_reference()
    assert "| `l` | `payload_len` | int | required | ≥ 0 |" in header


def test_wire_page_example_decodes_to_what_it_says() -> None:
    from protocols.wire.envelope import decode_message
    from protocols.wire.payload import decode_payload

    text = ref.wire_example_reference()
    hexed = "".join(text.split("one hex string:")[1].replace("```text", "").replace("```", "").split())
    header, body = decode_message(bytes.fromhex(hexed))
    payload = decode_payload(body)
    assert (header.kind, header.round, header.edge_round, header.sender) == ("device_result", 3, 1, "c0-d1")
    assert payload.meta == {"weight": 12, "loss": 0.5} and payload.tensors["b"].tolist() == [0.5, -1.0]


def test_every_security_promise_names_whom_it_holds_against_and_a_test_that_attacks_it() -> None:
    """Each row of the security page's table (but the one that promises nothing) points at tests, and each test it
    names exists: a promise whose test is renamed or gone is caught here."""
    text = (DOCS / "concepts" / "security.md").read_text()
    table = text[text.index("| who |") : text.index("## Threat model")]
    rows = [
        re.split(r"\s*\|\s*", line.strip()[1:-1].strip()) for line in table.splitlines()[2:] if line.startswith("| ")
    ]
    assert len(rows) >= 6
    for who, _can, holds, _how, attacked in rows:
        if holds == "not covered":
            continue
        refs = re.findall(r"`(tests/[\w/]+\.py)?((?:::\w+)?)`", attacked)
        assert refs and refs[0][0], f"row {who!r}: no test attacks it"
        current = ""
        for path, name in refs:
            current = path or current
            source = (ROOT / current).read_text()
            assert not name or f"def {name[2:]}(" in source, f"row {who!r}: {current}{name} does not exist"


def test_every_reference_marker_names_a_reference() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    used = {m for page in PAGES for m in mkdocs_hooks.MARKER.findall(page.read_text(encoding="utf-8"))}
    assert used == set(ref.REFERENCES), "each generated reference appears on a page, and only those"
    with pytest.raises(ValueError, match="unknown fedtier reference"):
        mkdocs_hooks.expand("<!-- fedtier-reference: nope -->")


# ------------------------------------------------------------------------------------ examples


def _toml_blocks() -> list[Block]:
    return [b for page in [*PAGES, ROOT / "README.md"] for b in blocks(page) if b.lang == "toml"]


@pytest.mark.parametrize("block", _toml_blocks(), ids=str)
def test_toml_example_goes_through_the_validator(block: Block, tmp_path: Path) -> None:
    job = re.match(r"job (\S+?);?(\s|$)", block.mark)
    if block.mark.startswith("pyproject"):  # packaging metadata: TOML, with the entry points it shows
        assert "fedtier.algorithms" in tomllib.loads(block.text)["project"]["entry-points"]
    elif job:  # a job file: validated against its federation, as fedtier submit does
        from protocols.config import load_config
        from protocols.jobs import canonical_job, read_job_file

        (tmp_path / "job.toml").write_text(block.text, encoding="utf-8")
        canonical_job(read_job_file(tmp_path / "job.toml").config, load_config(ROOT / job.group(1)))
    else:
        parse_config(tomllib.loads(block.text))  # raises ConfigError naming the key
    same = re.search(r"same-as (\S+)", block.mark)
    if same:
        assert block.text == (ROOT / same.group(1)).read_text(encoding="utf-8"), f"{block} differs from {same[1]}"


def _shell_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.lang in ("bash", "sh", "shell")]


def test_every_tutorial_block_that_does_not_run_says_why() -> None:
    for page in TUTORIALS:
        for b in _shell_blocks(page):
            if b.mark.startswith("syntax-only"):
                assert len(b.mark.split(":", 1)[-1].strip()) > 10, f"{b}: say why it cannot run here"
            result = subprocess.run(["bash", "-n"], input=b.text, capture_output=True, text=True)
            assert result.returncode == 0, f"{b}: {result.stderr}"


def _small(script: str) -> str:
    return re.sub(r"(fedtier (?:sim|run) \S+\.toml)", rf"\1 {SMALL}", script)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page", TUTORIALS, ids=lambda p: p.stem)
def test_tutorial_shell_blocks_run(page: Path, tmp_path: Path) -> None:
    """Each tutorial's blocks run in order in a scratch folder that has the repository's .venv and
    examples (what the page runs from the repository root), fedtier sim/run at small sizes."""
    runnable = [b for b in _shell_blocks(page) if not b.mark.startswith("syntax-only")]
    if not runnable:
        pytest.skip("no runnable block")
    for name in (".venv", "examples", "scripts", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for b in runnable:
        script = "set -euo pipefail\n" + _small(b.text)
        done = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (
            f"{b} failed ({done.returncode}):\n{script}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )


def test_deployment_tutorial_shows_the_commands_the_end_to_end_deployment_test_runs() -> None:
    from tests import test_federation as e2e

    shown = "\n".join(b.text for b in _shell_blocks(DOCS / "tutorials" / "deploy-fleet.md"))
    for line in (
        e2e.CLOUD,
        e2e.CELL.format(cell="c0"),
        e2e.AGENT.format(device="c0-d0"),
        e2e.JOBS_WAIT,
        e2e.SUBMIT.format(job="job-a.toml"),
        e2e.JOBS_LIST,
    ):
        assert line in shown, f"docs/tutorials/deploy-fleet.md does not show {line!r}"


@pytest.mark.timeout(600)
def test_how_to_blocks_marked_run_run(tmp_path: Path) -> None:
    """Shell blocks of the how-to guides marked ``<!-- docs-test: run -->`` run too (small sizes)."""
    marked = [b for page in sorted((DOCS / "how-to").glob("*.md")) for b in _shell_blocks(page) if b.mark == "run"]
    assert marked, "the write-an-algorithm guide runs its plugin command"
    for name in (".venv", "examples", "scripts", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    for b in marked:
        script = "set -euo pipefail\n" + _small(b.text)
        done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{b} failed:\n{script}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_readme_is_a_landing_page_with_the_two_commands_and_working_links() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150, "the README is a landing page: move details into docs/"
    for command in (
        "bash scripts/setup.sh && .venv/bin/fedtier run examples/quickstart.toml",
        "bash scripts/setup.sh && .venv/bin/python -m pytest -q -n auto",
    ):
        assert f"```bash\n{command}\n```" in text
    links = re.findall(r"\]\(([^)#\s]+)", text)
    assert len(links) >= 15
    for link in links:
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


def test_every_run_folder_a_shell_block_reads_is_one_a_shell_block_makes() -> None:
    """``fedtier report|logs|monitor runs/X`` in the docs' shell blocks read folders that some block's ``fedtier
    sim|run`` writes (``--set run.output=runs/X``, else the example config's own ``run.output``): the monitor page
    once compared ``runs/fedavg``, which no page makes."""
    from protocols.config import load_config

    shell = [b for page in [*PAGES, ROOT / "README.md"] for b in _shell_blocks(page)]
    made, read = set(), set()
    for line in (line for b in shell for line in b.text.splitlines()):
        line = line.split("#")[0]
        run = re.search(r"fedtier (?:sim|run) (examples/[\w-]+\.toml)", line)
        out = re.search(r"run\.output=(runs/[\w.-]+)", line)
        if out:
            made.add(out.group(1))
        elif run:
            made.add(str(load_config(ROOT / run.group(1)).output_dir()))
        if re.search(r"fedtier (?:report|logs|monitor) ", line):
            read |= set(re.findall(r"(runs/[\w.-]+)", line))
    assert read and read <= made, f"read but made by no block: {sorted(read - made)}"


def test_first_run_tutorial_ends_with_the_same_model_over_mqtt_as_in_simulation() -> None:
    """The claim the tutorial's emulation block checks with cmp, kept in its text."""
    page = (DOCS / "tutorials" / "first-run.md").read_text(encoding="utf-8")
    assert "cmp runs/quickstart/final_model.ftw runs/quickstart-mqtt/final_model.ftw" in page


# ------------------------------------------------------------------------------------ the example algorithm


# --8<-- [start:normclip]
def test_the_example_algorithm_learns_and_bounds_a_lying_device(tmp_path: Path, monkeypatch) -> None:
    from protocols.algorithms import ALGORITHMS
    from protocols.wire.payload import Payload
    from sim.launcher import run_simulation
    from tests.conftest import small_config

    monkeypatch.setitem(ALGORITHMS, "normclip", NormClip)  # register(NormClip), undone after the test
    cfg = small_config(tmp_path, algorithm={"name": "normclip", "max_norm": 5.0}, run={"rounds": 4})
    result = run_simulation(cfg)
    assert result.final_accuracy is not None and result.final_accuracy > 0.8  # it learns (chance: 0.1)

    # its declared traits decide what it combines with: secure aggregation needs a cell that sums
    with pytest.raises(ConfigError, match="clips each device's delta"):
        small_config(tmp_path, algorithm={"name": "normclip"}, privacy={"secure_aggregation": True})

    # a device that sends 1000x an honest delta moves its cell's model by at most max_norm
    algo = NormClip(cfg.train, cfg.model_spec((64,), 10), seed=0)
    model = algo.initial_params()
    cell = algo.cell("c0")
    cell.begin(0, Payload({}, model))
    honest = {k: np.full_like(v, 0.01) for k, v in model.items()}
    liar = {k: 1000 * v for k, v in honest.items()}
    results = {"c0-d0": Payload({"weight": 10}, honest), "c0-d1": Payload({"weight": 10}, liar)}
    for device, r in results.items():
        cell.check(device, r)  # both are well-formed
    assert cell.aggregate(0, results).metrics == {"clipped": 1}
    moved = np.sqrt(sum(np.sum((cell.model[k] - model[k]) ** 2) for k in model))
    assert moved <= (5.0 + np.sqrt(sum(np.sum(v**2) for v in honest.values()))) / 2 + 1e-4


# --8<-- [end:normclip]


# ------------------------------------------------------------------------------------ the built site

SCREENSHOT = ROOT / "scripts" / "report_screenshot.py"
_spec = importlib.util.spec_from_file_location("report_screenshot", SCREENSHOT)
shot = sys.modules.setdefault("report_screenshot", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(shot)  # type: ignore[union-attr]
PROBE = """<script>
window.addEventListener("load", () => {
  const header = document.querySelector(".md-header");
  const styled = header !== null && getComputedStyle(header).position === "sticky";  // Material's CSS applied
  const p = document.createElement("pre");
  p.id = "fedtier-probe";
  p.textContent = `docs-probe styled=${styled} tables=${document.querySelectorAll("table").length}`;
  document.body.appendChild(p);
});
</script>"""


@pytest.mark.skipif(
    shutil.which("chromium") is None and shot.find_chromium() is None, reason="chromium is not installed"
)
@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed (pip install -e '.[docs]')"
)
@pytest.mark.timeout(600)
def test_built_site_renders_home_and_config_reference_in_chromium(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    binary = shot.find_chromium()
    for page, expect in (
        (site / "index.html", ["A first run", "Deploying a fleet"]),
        (site / "reference" / "config" / "index.html", ["devices_per_cell", "the run seed"]),
    ):
        probe = page.with_name("probe.html")
        probe.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8")
        dom = shot._chromium(
            binary, tmp_path / f"profile-{page.parent.name}", "--dump-dom", probe.as_uri(), timeout=120
        )
        found = re.search(r"docs-probe styled=(\w+) tables=(\d+)", dom.stdout)
        assert found is not None, f"{page}: no probe result: {dom.stderr[-1000:]}"
        assert found.group(1) == "true", f"{page}: the theme's stylesheet did not apply"
        assert int(found.group(2)) >= 1
        for text in expect:
            assert text in dom.stdout, f"{page}: {text!r} not rendered"


def test_cell_processes_refusal_is_the_one_the_help_and_configure_page_quote(tmp_path: Path) -> None:
    """`fedtier sim --help` and docs/how-to/configure.md say what runtime.cell_processes refuses, quoting the error
    a user gets: the one `fedtier sim` prints (exit 2) for an asynchronous algorithm with sim workers."""
    from click.testing import CliRunner

    from fedtier.cli import main
    from tests.conftest import small_config

    cfg = small_config(
        tmp_path,
        algorithm={"mode": "async", "async_buffer": 2},
        runtime={"cell_processes": 2, "sim_workers": 1},
    )
    (tmp_path / "run.toml").write_text(cfg.to_toml(), encoding="utf-8")
    refused = CliRunner().invoke(main, ["sim", str(tmp_path / "run.toml"), "--no-progress"])
    assert refused.exit_code == 2, refused.output
    error = " ".join(refused.output.split())  # (the console wraps it)
    assert error.startswith("error: runtime.cell_processes = 2 does not support: an asynchronous algorithm")
    page = (ROOT / "docs/how-to/configure.md").read_text(encoding="utf-8")
    assert f"```text\n{error}\n```" in page
    helped = " ".join(CliRunner().invoke(main, ["sim", "--help"]).output.split())
    assert error.removeprefix("error: ") in helped.replace('"', "")
    for refusal in ("an asynchronous algorithm", "runtime.sim_workers", "runtime.onnx_devices", "more processes"):
        assert refusal in helped and refusal in page
