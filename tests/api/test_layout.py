"""The control plane's layout: an app module, one dependencies module, one thin route
module per resource that changes nothing itself (every write goes through
api/store.py), one JobState shared with the Ray side, and the command line and the
local stack in a package of their own."""

from __future__ import annotations

import ast
from pathlib import Path

from workers.state import ACTIVE, TERMINAL, JobState

ROOT = Path(__file__).parents[2]
ROUTES = ("jobs", "plan", "cluster", "tenants", "health")


def _calls(path: Path) -> set[str]:
    """Methods called anywhere in the module (``db.commit()`` -> ``commit``), except
    the router's own (``router.delete`` declares a route)."""
    tree = ast.parse(path.read_text())
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and getattr(node.func.value, "id", None) != "router"
    }


def test_the_api_is_laid_out_by_layer():
    api = ROOT / "api"
    assert (api / "main.py").is_file() and (api / "deps.py").is_file()
    assert sorted(p.stem for p in (api / "routes").glob("*.py") if p.stem != "__init__") == sorted(
        ROUTES
    )
    for name in ("cli", "client", "demo", "plan_cli", "report", "server", "service_cli"):
        assert not (api / f"{name}.py").exists() and (ROOT / "zscli" / f"{name}.py").is_file()


def test_routes_change_nothing_themselves():
    for name in ROUTES:
        calls = _calls(ROOT / "api" / "routes" / f"{name}.py")
        assert not calls & {"commit", "add", "add_all", "delete", "set_status", "flush"}, name


def test_one_job_state_for_both_sides():
    assert [s.value for s in JobState if s.is_terminal] == list(TERMINAL)
    assert [s.value for s in JobState if s.is_active] == list(ACTIVE)
    assert JobState("failed").is_terminal and not JobState("running").is_terminal
    for module in ("workers/supervisor.py", "api/store.py", "api/scheduler.py"):
        source = (ROOT / module).read_text()
        assert "from workers.state import" in source or "from .state import" in source, module
    assert "TERMINAL = (" not in (ROOT / "workers" / "supervisor.py").read_text()
    assert (
        "Literal[" not in (ROOT / "api" / "schemas.py").read_text().split("class JobOut")[1][:400]
    )


def _imports(package: str) -> dict[str, set[str]]:
    """Every module each file of ``package`` imports (absolute names; relative ones
    resolved within the package)."""
    out: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = path.relative_to(ROOT).with_suffix("").parts[: -node.level]
                    base = ".".join([*parts, base] if base else parts)
                names |= {base} | {f"{base}.{a.name}" for a in node.names}
        out[str(path.relative_to(ROOT))] = names
    return out


def _offending(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{path}: {name}"
        for path, names in _imports(package).items()
        for name in names
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    )


def test_the_engine_and_the_control_plane_keep_to_their_dependencies():
    # The engine: torch only (no cluster, service, store, metrics or tracking library).
    tracking = ("mlflow", "tensorboard", "torch.utils.tensorboard", "workers.tracking")
    service = ("ray", "fastapi", "sqlalchemy", "prometheus_client", "alembic")
    assert _offending("zeroservice", service + tracking) == []
    # Tracking is done where a job runs: the control plane never imports its libraries.
    assert _offending("api", tracking) == []
