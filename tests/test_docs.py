"""The documentation site cannot rot: it builds strictly, its generated pages match the code, its marked examples run
on the built-in model, and every flag, route, command and repository path it names exists."""

import importlib.util
import re
import shutil
import subprocess
import sys

import pytest

from tests.docs_examples import DOCS, ROOT, WITH_SERVER, Block, blocks, checkout_view, marked, run
from tests.live_server import running_server
from tools import docs_pages

PAGES = sorted(DOCS.rglob("*.md"))
GENERATED = {ROOT / path for path in docs_pages.pages()}
PAGES_WITH_EXAMPLES = [page for page in PAGES if marked(page)]


def _mkdocs_build(config_file, site_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config_file),
                           "--site-dir", str(site_dir)], capture_output=True, text=True, timeout=120)


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    result = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr


def test_the_strict_build_fails_on_a_broken_link_and_a_page_left_out_of_the_nav(tmp_path):
    """mkdocs reports these at levels that --strict may let through; mkdocs.yml's validation must make them fail."""
    pytest.importorskip("mkdocs")
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "index.md").open("a") as index:
        index.write("\n[a](serving.md#no-such-heading) [b](no-such-page.md)\n")
    (tmp_path / "docs" / "orphan.md").write_text("# Not in the nav\n")
    result = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    for problem in ("#no-such-heading", "no-such-page.md", "orphan.md"):
        assert problem in result.stderr


def test_the_generated_pages_are_current():
    stale = docs_pages.stale_pages()
    assert not stale, f"stale: {', '.join(map(str, stale))}; run `python -m tools.docs_pages` and commit the result"


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory):
    """A server on the built-in model (configs/tiny-cpu.yaml), started only for pages whose examples need one."""
    with running_server(tmp_path_factory.mktemp("docs-server")) as live:
        yield live


@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=[str(p.relative_to(DOCS)) for p in PAGES_WITH_EXAMPLES])
def test_the_marked_examples_run(page, tmp_path, request):
    examples = marked(page)
    server = request.getfixturevalue("docs_server") if any(b.marker == WITH_SERVER for b in examples) else None
    folder = checkout_view(tmp_path / "checkout")
    for block in examples:
        address = server.base_url.removeprefix("http://") if block.marker == WITH_SERVER else None
        result = run(block, folder, address)
        assert result.returncode == 0, (f"the example at {block.where} failed ({result.returncode}):\n{block.text}\n"
                                        f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")


# --- what the pages name exists -----------------------------------------------------------------------------------

def _checked_text(page) -> str:
    """The page without its `text` blocks, which show program output (error messages quote misspelt flags)."""
    text = page.read_text()
    for block in blocks(page):
        if block.language == "text":
            text = text.replace(block.text, "")
    return text


def _command_blocks() -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.language == "bash"]


def _known_flags() -> set[str]:
    from jaxserve.cli import _build_parser
    from tools.docs_pages import _subcommands

    flags = {flag for command in _subcommands(_build_parser()).values() for action in command._actions
             for flag in action.option_strings}
    # The repository's scripts and benchmarks, and mkdocs's one flag the pages use.
    for script in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("tools/*.py"), *ROOT.glob("scripts/*")]:
        flags |= set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", script.read_text()))
    return flags | {"--strict"}


def test_every_flag_the_pages_name_exists():
    known = _known_flags()
    named = {(page.name, flag) for page in PAGES
             for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _checked_text(page))}
    unknown = sorted(f"{page}: {flag}" for page, flag in named if flag not in known)
    assert not unknown, f"flags no command has: {unknown}"


def _route_key(route: str) -> str:
    return re.sub(r"<[^>]+>|\{[^}]+\}", "{}", route)


def test_every_route_is_documented_and_every_route_named_is_served():
    served = {_route_key(route) for source in ROOT.glob("jaxserve/server/*.py")
              for route in re.findall(r"""@blueprint\.(?:get|post)\("([^"]+)"\)""", source.read_text())}
    api_page = (DOCS / "openai-api.md").read_text()
    undocumented = sorted(route for route in served if route not in _route_key(api_page))
    assert not undocumented, f"routes the API page does not list: {undocumented}"
    named = {(page.name, _route_key(route)) for page in PAGES
             for route in re.findall(r"/v1(?:/(?:[a-z_]+|\{[a-z_]+\}))+", _checked_text(page))}
    unknown = sorted(f"{page}: {route}" for page, route in named if route not in served)
    assert not unknown, f"routes the server does not have: {unknown}"


def test_every_command_the_pages_run_exists():
    from jaxserve.cli import _build_parser
    from tools.docs_pages import _subcommands

    subcommands = set(_subcommands(_build_parser()))
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    problems = []
    for block in _command_blocks():
        for name in re.findall(r"(?:^|\s|/)jaxserve\s+([a-z][\w-]*)", block.text):
            if name not in subcommands:
                problems.append(f"{block.where}: jaxserve {name}")
        for name in re.findall(r"(?:^|\s)make\s+([a-z][\w-]*)", block.text):
            if name not in targets:
                problems.append(f"{block.where}: make {name}")
        for module in re.findall(r"python\s+-m\s+([\w.]+)", block.text):
            if module not in ("pip", "pytest", "mkdocs") and importlib.util.find_spec(module) is None:
                problems.append(f"{block.where}: python -m {module}")
    assert not problems, f"commands that do not exist: {problems}"


def test_every_repository_path_the_pages_name_exists():
    top = "benchmarks|scripts|configs|tools|tests|jaxserve|kernels_pallas"
    pattern = rf"(?<![\w/.-])(?:{top})/[\w./*-]*[\w*]"
    missing = sorted({f"{page.relative_to(DOCS)}: {path}" for page in PAGES if page not in GENERATED
                      for path in re.findall(pattern, page.read_text()) if not list(ROOT.glob(path))})
    assert not missing, f"paths the repository does not have: {missing}"


@pytest.mark.parametrize("readme", ["README.md"])
def test_the_readmes_links_lead_to_files_of_the_repository(readme):
    """The README is read on the repository's front page, outside the site: its links are relative to the root."""
    path = ROOT / readme
    if not path.is_file():
        pytest.skip(f"no {readme}")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    missing = sorted({t for t in targets if "://" not in t and not (ROOT / t).exists()})
    assert not missing, f"{readme} links to files that do not exist: {missing}"
