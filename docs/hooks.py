"""MkDocs hook: fills the pages from the project's own data at build time.

A page asks for generated text with an HTML comment on a line of its own:

    <!-- manifest: RoPEFwdOp -->        the op's manifest: tensors, backward, rules (tileops.docgen)
    <!-- ops-table[: zh] -->            every op and its summary, linked to the API reference
    <!-- manifest-schema -->            every manifest key, from tileops.manifest.schema.SCHEMA
    <!-- rule-language -->              the rule grammar, from tileops.manifest.expr
    <!-- targets -->                    the registered targets and their descriptions
    <!-- readme-commands -->            the setup commands of README.md
    <!-- include: PATH -->              a file of the repository, as a code block
    <!-- coverage -->                   the output of `tileops coverage --markdown`
    <!-- results: NAME -->              benchmarks/results/NAME: a .md file inlined (its links to
                                        PNGs beside it kept working), a .png as an image

Every family has an API page, ``api/<family>.md``, listed under "API reference" with no edit to
mkdocs.yml: the file in docs/ where one is written (``api/rope.md``), else a page generated from the
family (its package docstring, and for each op its class through mkdocstrings and its manifest's
tables: :func:`tileops.docgen.family_page_markdown`). Families of ``TILEOPS_FAMILY_PATH`` roots get
theirs the same way; :class:`FamilyRoots`, a griffe extension, shows mkdocstrings their packages.

Files are read from the repository (the folder of mkdocs.yml); the PNGs of benchmarks/results/ are
added to the site as generated files, never copied into docs/. A results file not committed yet
reads as a sentence saying so (a page may name one that a benchmark run is still to write). On a
page of the Chinese site that has no Chinese version, the English text is shown under a notice
saying so.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
import subprocess
import sys
from pathlib import Path

import griffe
from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

from tileops import docgen, family_names
from tileops.families import roots

log = logging.getLogger("mkdocs.hooks.tileops")

MARKER = re.compile(r"^<!--\s*([a-z-]+)(?::\s*(.+?))?\s*-->\s*$", re.MULTILINE)
FALLBACK_NOTICE = '!!! info "本页暂无中文版。以下为英文原文。"\n\n'
RESULTS = Path("benchmarks") / "results"
RESULTS_SITE = "assets/benchmarks"  # where the site publishes RESULTS' PNGs
RESULTS_PNG_LINK = re.compile(r"(!\[[^\]]*\])\(([\w.-]+\.png)\)")  # ![alt](NAME.png): a PNG beside the file
API_SECTION = "API reference"
OPS_TABLE_HEADERS = {"en": ("Op", "Family", "What it computes"), "zh": ("算子", "族", "计算内容（英文）")}
_LANG = {".py": "python", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml", ".md": "markdown", ".sh": "bash"}


def _root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _api_page(family: str) -> str:
    return f"api/{family}.md"


def on_config(config):
    """Every family's API page under "API reference" in the nav (those mkdocs.yml does not list)."""
    nav = config.nav or []
    section = next((e[API_SECTION] for e in nav if isinstance(e, dict) and API_SECTION in e), None)
    if section is None:
        section = []
        nav.append({API_SECTION: section})
    listed = {v for e in section for v in (e.values() if isinstance(e, dict) else [e])}
    for family in family_names():
        if _api_page(family) not in listed:
            section.append({docgen.family_title(family): _api_page(family)})
    config.nav = nav
    return config


@event_priority(-200)  # after the i18n plugin's (-100), which rebuilds each page from a file in docs/
def on_files(files, config):
    """The benchmark figures, and the generated API page of every family with none in docs/, for the
    language being built (the default one's text: another language's site shows it under the
    fallback notice)."""
    for png in sorted((_root(config) / RESULTS).glob("*.png")):
        if files.get_file_from_path(f"{RESULTS_SITE}/{png.name}") is None:
            files.append(File.generated(config, f"{RESULTS_SITE}/{png.name}", abs_src_path=str(png)))
    i18n = config.plugins.get("i18n")
    for family in family_names():
        if (Path(config.docs_dir) / _api_page(family)).is_file():
            continue
        text = docgen.family_page_markdown(family)
        if i18n is None:
            files.append(File.generated(config, _api_page(family), content=text))
            continue
        # what the i18n plugin gives each page: its version in every language (for the switcher)
        versions = {}
        for lang in sorted(i18n.build_languages):
            f = versions[lang] = File.generated(config, _api_page(family), content=text)
            if lang != i18n.default_language:
                f.dest_uri = f"{lang}/{f.dest_uri}"
            f.locale, f.locale_alternate_of, f.norm_src_uri = i18n.default_language, lang, f.src_uri
        for f in versions.values():
            f.alternates = versions
        files.append(versions[i18n.current_language])
    return files


class FamilyRoots(griffe.Extension):
    """Griffe extension: the family packages of ``TILEOPS_FAMILY_PATH`` roots, as the submodules of
    ``tileops`` they are at run time. Griffe reads ``tileops`` from its folder and, unlike Python,
    does not follow the extended ``__path__``; this reads each root's ``tileops/<family>/`` the
    same way (source only, nothing is imported)."""

    def on_package(self, *, pkg, loader, **kwargs):
        if pkg.name != "tileops":
            return
        for root in roots():
            for init in sorted((root / "tileops").glob("*/__init__.py")):
                family = self._visit(init.parent.name, init, pkg, loader)
                for path in sorted(init.parent.glob("*.py")):
                    if path.name != "__init__.py":
                        self._visit(path.stem, path, family, loader)
        loader.expand_exports(pkg)
        loader.expand_wildcards(pkg, external=False)

    @staticmethod
    def _visit(name: str, path: Path, parent, loader):
        module = griffe.visit(name, path, path.read_text(encoding="utf-8"), parent=parent,
                              docstring_parser=loader.docstring_parser, docstring_options=loader.docstring_options,
                              lines_collection=loader.lines_collection, modules_collection=loader.modules_collection)
        parent.set_member(name, module)
        return module


def on_page_markdown(markdown, page, config, files):
    root = _root(config)

    def expand(match: re.Match) -> str:
        kind, arg = match.group(1), (match.group(2) or "").strip()
        try:
            return _expand(kind, arg, root, page)
        except PluginError:
            raise
        except Exception as e:  # a broken generator must fail the build, naming the page
            raise PluginError(f"{page.file.src_uri}: <!-- {kind}{': ' + arg if arg else ''} -->: {e}") from e

    markdown = MARKER.sub(expand, markdown)
    f = page.file
    if getattr(f, "locale_alternate_of", None) not in (None, getattr(f, "locale", None)):
        # This language's build fell back to the default language's page.
        markdown = _after_title(markdown, FALLBACK_NOTICE)
    return markdown


def _after_title(markdown: str, text: str) -> str:
    m = re.match(r"\s*# .*\n", markdown)
    return markdown[: m.end()] + "\n" + text + markdown[m.end():] if m else text + markdown


def _expand(kind: str, arg: str, root: Path, page) -> str:
    if kind == "manifest":
        return f'#### Manifest {{ #{arg}-manifest }}\n\n' + docgen.op_markdown(arg, root)
    if kind == "ops-table":
        return docgen.ops_table_markdown(_rel("", page.file.src_uri), OPS_TABLE_HEADERS[arg or "en"])
    if kind == "manifest-schema":
        return docgen.schema_markdown(int(arg) if arg else 2)
    if kind == "rule-language":
        return docgen.rule_language_markdown()
    if kind == "targets":
        return docgen.targets_markdown()
    if kind == "readme-commands":
        return docgen.readme_commands_markdown(_readme(root))
    if kind == "include":
        path = (root / arg).resolve()
        if root not in path.parents or not path.is_file():
            raise PluginError(f"{page.file.src_uri}: include: no file {arg!r} in the repository")
        text = path.read_text(encoding="utf-8").rstrip("\n")
        return f'```{_LANG.get(path.suffix, "text")} title="{arg}"\n{text}\n```'
    if kind == "coverage":
        return _coverage()
    if kind == "results":
        return _results(root, arg, page)
    raise PluginError(f"{page.file.src_uri}: unknown marker <!-- {kind} -->; see docs/hooks.py")


def _rel(target: str, src_uri: str) -> str:
    depth = src_uri.count("/")
    return "../" * depth + target


def _readme(root: Path) -> str:
    readme = root / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    if not docgen.readme_commands(text):
        raise PluginError(f"{readme}: no setup command (a line starting `python3 -m venv`) to show")
    return text


@functools.lru_cache(maxsize=1)
def _coverage() -> str:
    unavailable = "*Coverage table not available:* {why}\n"
    if importlib.util.find_spec("tileops.cli_coverage") is None:
        return unavailable.format(why="this tileops has no `tileops coverage` command.")
    try:
        run = subprocess.run([sys.executable, "-m", "tileops", "coverage", "--markdown"], capture_output=True,
                             text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return unavailable.format(why="`tileops coverage --markdown` took over 10 minutes.")
    if run.returncode != 0 or not run.stdout.strip():
        log.warning("tileops coverage --markdown failed (exit %s): %s", run.returncode, run.stderr[-2000:])
        return unavailable.format(why=f"`tileops coverage --markdown` exited {run.returncode}.")
    return run.stdout


def _results(root: Path, name: str, page) -> str:
    if not re.fullmatch(r"[\w.-]+\.(md|png)", name):
        raise PluginError(f"{page.file.src_uri}: results: expected a .md or .png file name in {RESULTS}, got {name!r}")
    path = root / RESULTS / name
    if not path.is_file():
        return f"*`{RESULTS.as_posix()}/{name}` has not been committed yet.*\n"
    site = _rel(RESULTS_SITE, page.file.src_uri)
    if path.suffix == ".png":
        return f"![{RESULTS.as_posix()}/{name}]({site}/{name})\n"
    return RESULTS_PNG_LINK.sub(rf"\1({site}/\2)", path.read_text(encoding="utf-8").strip()) + "\n"
