"""Tokens per second of Hugging Face ``generate()`` in eager mode, rdnattention beside torch's sdpa
in the same run: a random-weight Llama-shaped model built from a config (nothing downloaded), fp16,
GQA 32/8 (head_dim 128), DynamicCache, greedy decoding.

    python -m tuning.generate                      # batch 1 and 8, 16 layers
    python -m tuning.generate --layers 4 --new 32  # a quick look
    python -m tuning.generate --calls              # host time per attention call inside generate()

Three ways of running the same model, timed in turn round after round, the order reversed every
other round (A B C, C B A, ...) so that a drift of the machine's speed weighs on each alike:
- sdpa: ``attn_implementation="sdpa"``, torch's own attention;
- rdnattention: ``attn_implementation="rdnattention"`` (rdnattention.integrations.transformers);
- sdpa, patched: ``attn_implementation="sdpa"`` inside ``rdnattention.sdpa_patched()``.
Each row also says how many of the attention calls our kernels served, and whether the greedy
tokens equal sdpa's (random weights make near-ties, so fp16 rounding may change a token late in
the sequence: the count of equal leading tokens is shown). Tokens/s are the median of the rounds;
each ratio is the median of the rounds' own ratios (the two timed next to each other in a round),
with their range: between processes, and on some starts of a machine between rounds, the speed of
the host moves by more than the differences measured here."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def _model(layers: int, hidden: int, heads: int, heads_kv: int, vocab: int, implementation: str, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.6875) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads_kv,
                         vocab_size=vocab, max_position_embeddings=4096, attn_implementation=implementation)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.float16).eval()
    return model


def _use(model, implementation: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(implementation)
    else:  # transformers before set_attn_implementation
        model.config._attn_implementation = implementation


def _generate(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              pad_token_id=0, use_cache=True)


def _leading_equal(a: torch.Tensor, b: torch.Tensor) -> int:
    same = (a == b).all(dim=0)
    return int(same.cumprod(0).sum())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes (default 1,8)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence (default 128)")
    p.add_argument("--new", type=int, default=128, help="generated tokens per sequence (default 128)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true",
                   help="instead of the table: cProfile of one generate() of sdpa and of rdnattention at the first "
                        "batch size, the functions that differ most in time per generated token")
    p.add_argument("--calls", action="store_true",
                   help="instead of the table: the host time of each attention call inside generate() (the attention "
                        "function timed as transformers calls it, rdnattention's and its sdpa attention), round after "
                        "round, with each generate()'s wall time")
    p.add_argument("--device", default="cuda", help="cuda (default); cpu runs the host kernels (a smoke test of "
                                                     "this script, no figure to compare)")
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1

    import transformers

    import rdnattention
    import rdnattention.integrations.transformers as rt

    rt.register()
    model = _model(args.layers, args.hidden, 32, 8, 32000, "sdpa", args.device)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name() if cuda else 'CPU'}; Llama-shaped, {args.layers} layers, hidden {args.hidden}, "
          f"heads 32/8, fp16, eager, DynamicCache, prompt {args.prompt}, {args.new} new tokens, greedy\n")
    if not args.calls:
        print("| batch | sdpa tokens/s | rdnattention tokens/s | ratio | served | equal leading tokens | "
              "sdpa patched tokens/s | ratio | served | equal leading tokens |")
        print("|---|---|---|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        g = torch.Generator(device=args.device).manual_seed(batch)
        prompt = torch.randint(1, 32000, (batch, args.prompt), device=args.device, generator=g)

        def sdpa():
            _use(model, "sdpa")
            return _generate(model, prompt, args.new)

        def ours():
            _use(model, rt.NAME)
            return _generate(model, prompt, args.new)

        def patched():
            _use(model, "sdpa")
            with rdnattention.sdpa_patched(devices=args.device):
                return _generate(model, prompt, args.new)

        if args.calls:
            _calls(model, prompt, args.new, args.rounds, batch, sync)
            continue
        runs = {"sdpa": sdpa, "ours": ours, "patched": patched}
        outputs = {name: fn() for name, fn in runs.items()}  # warm-up: plans, kernels, allocator
        if args.profile:
            _profile({"sdpa": sdpa, "rdnattention": ours}, batch * args.new, sync)
            return 0
        served = {}
        for name in ("ours", "patched"):
            rt.counts(reset=True)
            before = rdnattention.stats()
            runs[name]()
            after = rdnattention.stats()
            fallbacks = rt.counts()["fallbacks"]
            served[name] = (before, after, sum(fallbacks.values()))
            if name == "ours":
                reasons = fallbacks
        times: dict[str, list[float]] = {name: [] for name in runs}
        order = list(runs.items())
        for r in range(args.rounds):
            for name, fn in order if r % 2 == 0 else order[::-1]:
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - t0)
        rate = {name: batch * args.new / statistics.median(t) for name, t in times.items()}
        row = [str(batch), f"{rate['sdpa']:.0f}"]
        for name in ("ours", "patched"):
            before, after, fell_back = served[name]
            if name == "ours":
                calls = args.layers * args.new  # one forward pass per generated token
                shown = f"{calls - fell_back} of {calls}" + (f", fallbacks {reasons}" if fell_back else "")
            else:
                shown = _patched_served(before, after)
            ratios = sorted(a / b for a, b in zip(times["sdpa"], times[name]))  # each round's, paired
            spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else ""
            row += [f"{rate[name]:.0f}", f"{statistics.median(ratios):.2f}x{spread}", shown,
                    f"{_leading_equal(outputs[name][:, args.prompt:], outputs['sdpa'][:, args.prompt:])} of {args.new}"]
        print("| " + " | ".join(row) + " |", flush=True)
    return 0


def _calls(model, prompt: torch.Tensor, new: int, rounds: int, batch: int, sync) -> None:
    """Per round, for rdnattention's attention function and transformers' sdpa attention, each
    registered under a name of its own with a timer around it: the wall time of one generate() and
    the mean host time of an attention call within it (the call's return, not its kernels' end)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    import rdnattention.integrations.transformers as rt

    spent = {"rdnattention": [0.0, 0], "sdpa": [0.0, 0]}

    def timed(name, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name][0] += time.perf_counter() - t0
                spent[name][1] += 1
        registered = f"timed_{name}"
        AttentionInterface.register(registered, call)
        AttentionMaskInterface.register(registered, sdpa_mask)
        return registered

    names = {"rdnattention": timed("rdnattention", rt.attention_forward), "sdpa": timed("sdpa", sdpa_attention_forward)}
    for name, registered in names.items():  # warm-up
        _use(model, registered)
        _generate(model, prompt, new)
    print(f"| batch | round | attention | generate() ms | attention calls | host us per call |\n|---|---|---|---|---|---|")
    for r in range(rounds):
        for name, registered in names.items():
            spent[name] = [0.0, 0]
            _use(model, registered)
            sync()
            t0 = time.perf_counter()
            _generate(model, prompt, new)
            sync()
            total = time.perf_counter() - t0
            seconds, calls = spent[name]
            print(f"| {batch} | {r + 1} | {name} | {total * 1e3:.0f} | {calls} | {seconds / max(calls, 1) * 1e6:.1f} |",
                  flush=True)


def _profile(runs: dict, tokens: int, sync) -> None:
    """cProfile of each of ``runs`` (one generate() each): per function, its own time per generated
    token in each, the functions whose times differ most first (where the time goes that one spends
    and the other does not)."""
    import cProfile
    import pstats

    from pathlib import Path

    import rdnattention

    root = str(Path(rdnattention.__file__).parents[1]) + "/"  # the checkout's files by their paths in it
    own: dict[str, dict[str, float]] = {}
    for name, fn in runs.items():
        prof = cProfile.Profile()
        sync()
        prof.enable()
        fn()
        sync()
        prof.disable()
        stats = pstats.Stats(prof).stats
        total = sum(tt for _, _, tt, _, _ in stats.values())
        print(f"{name}: {total / tokens * 1e3:.3f} ms of profiled time per generated token")
        for (file, line, func), (_, calls, tt, _, _) in stats.items():
            where = f"{file.rsplit('site-packages/', 1)[-1].removeprefix(root)}:{line}({func})"
            own.setdefault(where, {})[name] = tt / tokens * 1e6
    names = list(runs)
    rows = sorted(own.items(), key=lambda kv: -abs(kv[1].get(names[1], 0) - kv[1].get(names[0], 0)))
    print(f"\n| function | {names[0]} us per token | {names[1]} us per token |\n|---|---|---|")
    for where, t in rows[:40]:
        print(f"| {where} | {t.get(names[0], 0):.1f} | {t.get(names[1], 0):.1f} |")


def _patched_served(before: dict, after: dict) -> str:
    """The SDPA patch's served and fallen-back call counts between two stats() snapshots."""
    served = after["served"] - before["served"]
    fell = {k: v - before["fallbacks"].get(k, 0) for k, v in after["fallbacks"].items()}
    fell = {k: v for k, v in fell.items() if v}
    return f"{served} served" + (f", fallbacks {fell}" if fell else "")


if __name__ == "__main__":
    sys.exit(main())
