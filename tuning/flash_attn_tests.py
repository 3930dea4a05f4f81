"""flash-attn's own ``tests/test_flash_attn.py`` run against rdnattention's flash-attn entry points.

    python -m tuning.flash_attn_tests --flash-attn-tests PATH/test_flash_attn.py \\
        [--device cuda|cpu] [--max-cases N] [-k EXPR] [--max-cost C] [--out FILE]

The test file is read from the path given (a flash-attention checkout's); nothing of it is kept.
For the run only, a ``flash_attn`` package is put first on ``sys.path`` from a temporary directory:
its entry points (flash_attn_func, the kvpacked, qkvpacked and varlen forms,
flash_attn_with_kvcache) are rdnattention's, and its helpers (``bert_padding``,
``layers.rotary.apply_rotary_emb``, ``flash_attn_interface._get_block_size_n``) are
tuning/flash_attn_shim.py's. pytest then runs the file in this process, and each case is put in
one bucket:

* passed;
* refused: an rdnattention UnsupportedError (dropout, a head_dim no kernel serves, ...), grouped by
  its message;
* forward passed, backward not served: the call's gradients are rdnattention's own where it has
  them; where a call with grad-requiring inputs is refused (no backward pass for the KV cache or
  paged packed sequences, no backward kernel for the head_dim or dtype) but its forward is served, the
  shim runs the forward alone and its backward returns NaN placeholder gradients
  (flash_attn_shim.py). A case lands here when the statement that failed (an assertion, or any
  error such as a tolerance computed from a gradient) is about a placeholder gradient, so every
  assertion before it (the forward ones) passed; its reason is the refusal and how many
  assertions passed (pytest's assertion-pass hook), none meaning a backward-only test;
* failed: any other assertion or exception, with the case id: a bug to look at;
* skipped by the test (its own pytest.skip), and not applicable (it imports flash-attn internals
  the shim does not serve, e.g. the raw C++ extension).

``--device cpu`` runs on the host emulator: the test file's hard-coded "cuda" device strings and
CUDA capability queries are rewritten in a patched copy (the capability read as (9, 0), the H200
the cuda proxy target is, so the file parametrises bf16 as well), and only cases whose work
``batch * heads * seqlen_q * seqlen_k * head_dim * repeats`` is at most ``--max-cost`` (default
2**25 on cpu, a few seconds a case; unbounded on cuda) are collected. batch, heads and repeats
(``for _ in range(N)`` loops) are read from the test function's source, seqlens and head_dim from
its parameters; a case without seqlen parameters is always kept. ``--max-cases N`` then keeps N of them, spread over the
test functions (round robin, each function's cases in a seeded shuffle).

The summary (counts, refusals by reason, failures with ids, counts per test function) is printed
and written as markdown to ``--out`` (default tuning/results/<device>_flash_attn_tests.md). The
exit status is 1 when a case failed."""

from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import inspect
import random
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BUCKETS = ("passed", "refused", "forward_only", "failed", "skipped", "not_applicable")
TITLES = {"passed": "passed", "refused": "refused (UnsupportedError)",
          "forward_only": "forward passed, backward not served", "failed": "failed",
          "skipped": "skipped by the test", "not_applicable": "not applicable (flash-attn internals)"}
CPU_MAX_COST = 2 ** 25
ROOT = Path(__file__).resolve().parent.parent

# The shim package: each module re-exports tuning.flash_attn_shim's names.
SHIM_MODULES = {
    "flash_attn/__init__.py": "from tuning.flash_attn_shim import (  # noqa: F401\n"
                              "    flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,\n"
                              "    flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,\n"
                              "    flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)\n"
                              "__version__ = '2.8.3'  # the API rdnattention's entry points follow\n",
    "flash_attn/flash_attn_interface.py": "from tuning.flash_attn_shim import (  # noqa: F401\n"
                                          "    USE_TRITON_ROCM, _get_block_size_n, flash_attn_func,\n"
                                          "    flash_attn_kvpacked_func, flash_attn_qkvpacked_func,\n"
                                          "    flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,\n"
                                          "    flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache)\n",
    "flash_attn/bert_padding.py": "from tuning.flash_attn_shim import pad_input, unpad_input  # noqa: F401\n",
    "flash_attn/layers/__init__.py": "",
    "flash_attn/layers/rotary.py": "from tuning.flash_attn_shim import apply_rotary_emb  # noqa: F401\n",
}

# --device cpu: (pattern, replacement, what) applied to the test file's text.
CPU_REWRITES = (
    (r"torch\.cuda\.get_device_capability\(\s*(\"cuda\"|'cuda')?\s*\)", "(9, 0)", "CUDA capability read as (9, 0)"),
    (r"torch\.cuda\.get_device_properties\(\s*(\"cuda\"|'cuda')?\s*\)\.total_memory", "(1 << 40)",
     "device memory read as 1 TiB"),
    (r"torch\.cuda\.synchronize\(\s*\)", "None", "torch.cuda.synchronize() dropped"),
    (r"(\"cuda\"|'cuda')", '"cpu"', '"cuda" device strings made "cpu"'),
)


def cpu_source(text: str) -> tuple[str, list[str]]:
    """The test file's text for the host emulator, and what was rewritten (with counts)."""
    done = []
    for pattern, replacement, what in CPU_REWRITES:
        text, n = re.subn(pattern, replacement, text)
        if n:
            done.append(f"{what} ({n}x)")
    return text, done


def _source_int(source: str, pattern: str, default: int) -> int:
    m = re.search(pattern, source)
    return int(m.group(1)) if m else default


@functools.cache
def _source_sizes(function) -> tuple[int, int, int]:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        source = ""
    batch = _source_int(source, r"\bbatch_size\s*=\s*(\d+)", 1)
    heads = _source_int(source, r"\bnheads\s*=\s*(\d+)", 1)
    repeats = max([1, *(int(n) for n in re.findall(r"for\s+\w+\s+in\s+range\(\s*(\d+)\s*\)", source))])
    return batch, heads, repeats


def case_cost(params: dict, function) -> int | None:
    """batch * heads * seqlen_q * seqlen_k * head_dim * repeats of a case with ``params`` of test
    ``function``, or None when its parameters name no seqlen. batch, heads and repeats come from the
    function's source (``batch_size = N``, ``nheads = N``, the largest ``for ... in range(N)``), 1
    when absent; head_dim is 64 when not a parameter."""
    seq_q = params.get("seqlen_q", params.get("seqlen"))
    seq_k = params.get("seqlen_k", params.get("seqlen"))
    if seq_q is None or seq_k is None:
        return None
    batch, heads, repeats = _source_sizes(function)
    return batch * heads * int(seq_q) * int(seq_k) * int(params.get("d", 64)) * repeats


def keyword_filter(expr: str | None, module: str):
    """A predicate on (function name, parametrisation id) approximating pytest's ``-k`` (a
    case-insensitive substring match on the module's and the case's names), or None where pytest's
    expression parser is not importable (pytest still applies -k after collection)."""
    if not expr:
        return None
    try:
        from _pytest.mark.expression import Expression
        compiled = Expression.compile(expr)
    except Exception:  # noqa: BLE001  (a private API: fall back to pytest's own -k)
        return None

    def accept(function: str, case_id: str) -> bool:
        names = [module, function, f"{function}[{case_id}]", case_id]
        return compiled.evaluate(lambda sub, **_: any(sub.lower() in n.lower() for n in names))

    return accept


def spread(items: list, n: int, seed: int = 0) -> list:
    """n of ``items``, round robin over their test functions, each function's in a seeded shuffle;
    returned in collection order."""
    groups: dict[str, list] = collections.defaultdict(list)
    for i, item in enumerate(items):
        groups[item.originalname if hasattr(item, "originalname") else item.name].append(i)
    rng = random.Random(seed)
    for members in groups.values():
        rng.shuffle(members)
    picked: list[int] = []
    queues = list(groups.values())
    while len(picked) < n and any(queues):
        for q in queues:
            if q and len(picked) < n:
                picked.append(q.pop())
    return [items[i] for i in sorted(picked)]


def _norm(message: str) -> str:
    """A refusal's message as a grouping key: numbers and tensor reprs made '…'."""
    first = message.strip().splitlines()[0] if message.strip() else type(message).__name__
    first = re.sub(r"\btensor\([^)]*\)", "…", first)
    first = re.sub(r"(?<![\w.])-?\d+(\.\d+)?(e-?\d+)?", "…", first)
    return first[:220]


@dataclass
class Outcome:
    bucket: str
    reason: str = ""


@dataclass
class Run:
    device: str
    test_file: str
    digest: str
    collected: int = 0
    over_cost: int = 0
    not_matching: int = 0
    sampled_out: int = 0
    rewrites: list[str] = field(default_factory=list)
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    def counts(self) -> collections.Counter:
        return collections.Counter(o.bucket for o in self.outcomes.values())


class Classifier:
    """The pytest plugin: selects the cases (cost bound, --max-cases) and puts each in a bucket."""

    def __init__(self, run: Run, test_path: Path, max_cost: int | None, max_cases: int | None, seed: int,
                 keyword: str | None = None):
        from rdnattention.errors import UnsupportedError
        from tuning.flash_attn_shim import STATE
        self.run, self.test_path, self.max_cost, self.max_cases, self.seed = run, test_path, max_cost, max_cases, seed
        self.keyword, self.keyword_expr = keyword_filter(keyword, test_path.name), keyword
        self.dropped: set[str] = set()
        self.asserts_passed = 0
        self.unsupported, self.state = UnsupportedError, STATE

    @pytest.hookimpl(hookwrapper=True)  # the old-style wrapper: pytest 7 has no wrapper=True
    def pytest_generate_tests(self, metafunc):
        """Prunes a function's parametrisations before pytest makes items of them (flash-attn's file
        has hundreds of thousands): over the cost bound, not matching -k, and, with --max-cases, a
        seeded sample of at most that many per function (the final spread is in
        pytest_collection_modifyitems)."""
        yield
        calls = metafunc._calls  # the callspecs pytest is about to make items of
        if not calls:
            return
        self.run.collected += len(calls)
        name = metafunc.function.__name__
        keep = []
        for spec in calls:
            cost = case_cost(spec.params, metafunc.function) if self.max_cost is not None else None
            if cost is not None and cost > self.max_cost:
                self.run.over_cost += 1
            elif self.keyword is not None and not self.keyword(name, spec.id):
                self.run.not_matching += 1
            else:
                keep.append(spec)
        if self.max_cases is not None and len(keep) > self.max_cases:
            rng = random.Random(f"{self.seed}:{name}")
            chosen = set(rng.sample(range(len(keep)), self.max_cases))
            self.run.sampled_out += len(keep) - len(chosen)
            keep = [spec for i, spec in enumerate(keep) if i in chosen]
        if not keep:  # pytest would make one unparametrised item of an empty list: keep one, dropped later
            keep = calls[:1]
            self.dropped.add(f"{name}[{keep[0].id}]")
        calls[:] = keep

    def pytest_collection_modifyitems(self, session, config, items):
        self.run.collected += sum(1 for item in items if not hasattr(item, "callspec"))
        keep = [item for item in items if item.name not in self.dropped]
        matching = [item for item in keep if self._matches(item)]
        self.run.not_matching += len(keep) - len(matching)
        keep = matching
        if self.max_cases is not None and len(keep) > self.max_cases:
            chosen = spread(keep, self.max_cases, self.seed)
            self.run.sampled_out += len(keep) - len(chosen)
            keep = chosen
        ids = {id(i) for i in keep}
        drop = [i for i in items if id(i) not in ids]
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep

    def _matches(self, item) -> bool:
        """pytest's own -k on ``item`` (applied here, before --max-cases spreads the cases)."""
        if self.keyword_expr is None:
            return True
        try:
            from _pytest.mark import KeywordMatcher
            from _pytest.mark.expression import Expression
            return Expression.compile(self.keyword_expr).evaluate(KeywordMatcher.from_item(item))
        except Exception:  # noqa: BLE001  (a private API: pytest applies -k itself afterwards)
            return True

    def pytest_runtest_setup(self, item):
        self.state.reset()
        self.asserts_passed = 0

    def pytest_assertion_pass(self, item, lineno, orig, expl):
        self.asserts_passed += 1

    def pytest_runtest_logreport(self, report):
        if report.nodeid in self.run.outcomes and report.when != "call":
            return  # the call phase decided; a teardown does not change it
        if report.when == "setup" and report.passed:
            return
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.run.outcomes[report.nodeid] = Outcome("skipped", reason.removeprefix("Skipped: "))
        elif report.passed:
            self.run.outcomes[report.nodeid] = Outcome("passed")
        elif report.nodeid not in self.run.outcomes:  # classified in pytest_exception_interact
            self.run.outcomes[report.nodeid] = Outcome("failed", _first_line(str(report.longrepr)))

    def pytest_exception_interact(self, node, call, report):
        if call.excinfo is None or not hasattr(node, "nodeid"):
            return
        self.run.outcomes[node.nodeid] = self.classify(call.excinfo)

    def classify(self, excinfo) -> Outcome:
        exc = excinfo.value
        for e in _chain(exc):
            if isinstance(e, self.unsupported):
                return Outcome("refused", _first_line(str(e)))
        if isinstance(exc, ImportError) and "flash_attn" in str(exc):  # the shim's path dropped from the message
            return Outcome("not_applicable", re.sub(r"\s*\([^()]*\)\s*$", "", _first_line(str(exc))))
        if self.state.backward_calls and self._about_placeholder(excinfo):
            n = self.asserts_passed
            why = self.state.refusals[0] if self.state.refusals else "backward not served"
            return Outcome("forward_only", f"{why} -- " + (f"assertions passed before the first about a gradient: {n}"
                           if n else "no assertion before the first about a gradient (a backward-only test)"))
        where = self._where(excinfo)
        return Outcome("failed", f"{type(exc).__name__}: {_first_line(str(exc))}" + (f" [{where}]" if where else ""))

    def _test_entry(self, excinfo):
        for entry in reversed(excinfo.traceback):
            if Path(str(entry.path)).resolve() == self.test_path.resolve():
                return entry
        return None

    def _where(self, excinfo) -> str:
        entry = self._test_entry(excinfo)
        if entry is None:
            return ""
        return f"line {entry.lineno + 1}: {str(entry.statement).strip().splitlines()[0][:120]}"

    def _about_placeholder(self, excinfo) -> bool:
        """The failed statement (in the test file) names a placeholder gradient: a tensor that is
        one (or views one), or whose ``.grad`` is one or is all NaN (a placeholder accumulated)."""
        import torch

        entry = self._test_entry(excinfo)
        if entry is None:
            return False
        names = set(re.findall(r"[A-Za-z_]\w*", str(entry.statement)))
        frame_locals = entry.frame.f_locals
        for name in names:
            value = frame_locals.get(name)
            values = value if isinstance(value, (tuple, list)) else (value,)
            for t in values:
                if not isinstance(t, torch.Tensor):
                    continue
                if self.state.is_placeholder(t):
                    return True
                g = t.grad if t.is_leaf else None
                if g is not None and (self.state.is_placeholder(g) or (g.is_floating_point() and g.numel()
                                                                       and bool(g.isnan().all()))):
                    return True
        return False


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0][:240] if lines else ""


def _install_shim(tmp: Path) -> Path:
    shim = tmp / "shim"
    for rel, text in SHIM_MODULES.items():
        path = shim / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return shim


def _drop_modules(prefixes: tuple[str, ...]) -> dict:
    gone = {name: mod for name, mod in sys.modules.items()
            if any(name == p or name.startswith(p + ".") for p in prefixes)}
    for name in gone:
        del sys.modules[name]
    return gone


def run_tests(test_file: Path, device: str, *, max_cases: int | None = None, keyword: str | None = None,
              max_cost: int | None = None, seed: int = 0, pytest_args: tuple[str, ...] = ()) -> Run:
    """Runs ``test_file`` under the shim (in this process) and returns its cases' outcomes."""
    import torch  # noqa: F401  (before rdnattention: its API loads with torch present)

    import rdnattention  # noqa: F401

    text = test_file.read_text()
    run = Run(device=device, test_file=str(test_file), digest=hashlib.sha256(text.encode()).hexdigest()[:12])
    if device == "cpu":
        text, run.rewrites = cpu_source(text)
    tmp = Path(tempfile.mkdtemp(prefix="rdnattention-fa-tests-"))
    old_path = list(sys.path)
    saved = _drop_modules(("flash_attn", test_file.stem))
    try:
        shim = _install_shim(tmp)
        tests = tmp / "tests"
        tests.mkdir()
        (tests / "pytest.ini").write_text("[pytest]\nenable_assertion_pass_hook = true\n")
        copy = tests / test_file.name
        copy.write_text(text)
        sys.path[:0] = [str(shim), str(ROOT)]
        plugin = Classifier(run, copy, max_cost, max_cases, seed, keyword)
        args = [str(copy), "-c", str(tests / "pytest.ini"), "--rootdir", str(tests), "-p", "no:cacheprovider",
                "-q", "--tb=no", "-rN", "--no-header", "-W", "ignore::DeprecationWarning", *pytest_args]
        if keyword:
            args += ["-k", keyword]
        pytest.main(args, plugins=[plugin])
    finally:
        sys.path[:] = old_path
        _drop_modules(("flash_attn", test_file.stem))
        sys.modules.update(saved)
        shutil.rmtree(tmp, ignore_errors=True)
    return run


def _function(nodeid: str) -> str:
    return nodeid.split("::")[-1].split("[")[0]


def summary(run: Run, command: str = "") -> str:
    """The run as markdown."""
    counts = run.counts()
    lines = [f"# flash-attn's test_flash_attn.py against rdnattention ({run.device})", ""]
    if command:
        lines += [f"    {command}", ""]
    lines += [(f"Test file: `{Path(run.test_file).name}` (sha256 {run.digest}). Collected {run.collected} cases; "
               f"{run.over_cost} over the cost bound, {run.not_matching} not matching -k, "
               f"{run.sampled_out} left out by --max-cases, {len(run.outcomes)} run."), ""]
    if run.rewrites:
        lines += ["Rewritten for the host emulator: " + "; ".join(run.rewrites) + ".", ""]
    lines += ["| outcome | cases |", "|---|---|"]
    lines += [f"| {TITLES[b]} | {counts.get(b, 0)} |" for b in BUCKETS]
    groups: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for o in run.outcomes.values():
        if o.bucket in ("refused", "forward_only", "skipped", "not_applicable"):
            groups[o.bucket, _norm(o.reason)].append(o.reason)
    if groups:
        lines += ["", "## Refused, forward-only, skipped and not applicable, by reason", "",
                  "| outcome | reason (numbers as …) | cases | an example |", "|---|---|---|---|"]
        for (bucket, key), reasons in sorted(groups.items(), key=lambda kv: (BUCKETS.index(kv[0][0]), -len(kv[1]))):
            lines.append(f"| {bucket} | {_cell(key)} | {len(reasons)} | {_cell(reasons[0])} |")
    failed = [(nodeid, o.reason) for nodeid, o in run.outcomes.items() if o.bucket == "failed"]
    if failed:
        lines += ["", "## Failed", "", "| case | error |", "|---|---|"]
        lines += [f"| `{nodeid.split('::')[-1]}` | {_cell(reason)} |" for nodeid, reason in failed]
    per = collections.defaultdict(collections.Counter)
    for nodeid, o in run.outcomes.items():
        per[_function(nodeid)][o.bucket] += 1
    if per:
        lines += ["", "## Per test function", "", "| test | " + " | ".join(TITLES[b] for b in BUCKETS) + " |",
                  "|---|" + "---|" * len(BUCKETS)]
        for fn, c in per.items():
            lines.append(f"| {fn} | " + " | ".join(str(c.get(b, 0)) for b in BUCKETS) + " |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flash-attn-tests", required=True, type=Path, metavar="PATH",
                   help="flash-attention's tests/test_flash_attn.py")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (a GPU) or cpu (the host emulator); default cuda where torch sees one")
    p.add_argument("--max-cases", type=int, default=None, help="run at most N cases, spread over the test functions")
    p.add_argument("-k", dest="keyword", default=None, help="pytest's -k expression")
    p.add_argument("--max-cost", type=int, default=None,
                   help=f"keep cases with batch*heads*seqlen_q*seqlen_k*head_dim*repeats <= C "
                        f"(default {CPU_MAX_COST} on cpu, no bound on cuda)")
    p.add_argument("--seed", type=int, default=0, help="the --max-cases shuffle's seed")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown summary (default tuning/results/<device>_flash_attn_tests.md)")
    args = p.parse_args(argv)
    if not args.flash_attn_tests.is_file():
        p.error(f"--flash-attn-tests {args.flash_attn_tests}: no such file")
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    max_cost = args.max_cost if args.max_cost is not None else (CPU_MAX_COST if device == "cpu" else None)
    run = run_tests(args.flash_attn_tests, device, max_cases=args.max_cases, keyword=args.keyword,
                    max_cost=max_cost, seed=args.seed)
    command = "python -m tuning.flash_attn_tests " + " ".join(
        a if a != str(args.flash_attn_tests) else f"PATH/{args.flash_attn_tests.name}"
        for a in (argv if argv is not None else sys.argv[1:]))
    text = summary(run, command)
    print(text)
    out = args.out or ROOT / "tuning" / "results" / f"{device}_flash_attn_tests.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")
    return 1 if run.counts().get("failed") else 0


if __name__ == "__main__":
    raise SystemExit(main())
