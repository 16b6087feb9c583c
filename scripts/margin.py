"""The contract's margin by batch size on the GPU: for each batch, the entry point
(vitattn_bwd.attention_block_backward, ln_grad "contract", as contract.run calls it) on
the benchmark's inputs against the float64 reference, per output: matched fraction
under the rule |out - ref| <= 1e-2 + 1e-2 |ref|, misses, normwise relative error and
the reference's RMS; and the autotune choices Inductor timed for that batch (a batch
that recompiles, as 420 does after 32, tunes again).

    TORCHINDUCTOR_CACHE_DIR=$OUT/inductor PYTHONPATH=. python3 scripts/margin.py \\
        --batches 32,56,420,1850 --out $OUT

(an empty Inductor cache, so that autotuning runs and its choices are seen). Writes
margin.json in --out and prints a table, the choices, then the worst matched fraction
per batch last.

The reference runs in chunks of the batch (P of 64 samples in float64 is 2.7 GB): the
contract's outputs other than grad_x are sums over the batch, added up per chunk in
float64. Memory at batch 1,850: the inputs are 70 GB (P alone 39 GB) in float32.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vitattn_bwd import attention_block_backward, reference  # noqa: E402
from vitattn_bwd.workloads import NUM_HEADS, OUTPUT_NAMES, make_inputs  # noqa: E402

CHUNK = 64
VECTORS = ("grad_ln_weight", "grad_ln_bias", "grad_out_bias")     # 1,024 elements each


def _misses(out, ref):
    return ((out.double() - ref).abs() > 1e-2 + 1e-2 * ref.abs()).sum().item()


def _chunk(value, start):
    """Samples start .. start + CHUNK of a batched input ([B,..], 3-d and up) in float64;
    weights in float64; scalars as they are."""
    if not torch.is_tensor(value):
        return value
    return (value[start:start + CHUNK] if value.dim() > 2 else value).double()


def contract_margins(batch, seed=0, precision="high", device="cuda"):
    """{output name: {"matched", "misses", "numel", "relative_error", "ref_rms"}} of the
    entry point at `batch` (577 tokens, 1024 wide, 16 heads) against float64."""
    if device == "cuda":
        # an earlier batch's freed blocks, cached, fragment the allocator's segments
        # (before batch 1,850: 42.6 GiB reserved but unallocated)
        torch.cuda.empty_cache()
    generator = torch.Generator(device=device).manual_seed(seed)
    inputs = make_inputs(batch, device=device, generator=generator)
    outputs = attention_block_backward(**inputs, num_heads=NUM_HEADS, ln_grad="contract",
                                       precision=precision)
    outputs = [t.detach() for t in outputs]
    sums, x_misses, x_error2, x_ref2 = None, 0, 0.0, 0.0
    with torch.no_grad():
        for start in range(0, batch, CHUNK):
            chunk = {name: _chunk(t, start) for name, t in inputs.items()}
            refs = reference.attention_block_backward(**chunk, num_heads=NUM_HEADS,
                                                      ln_grad="contract")
            grad_x = outputs[0][start:start + CHUNK]
            x_misses += _misses(grad_x, refs[0])
            x_error2 += ((grad_x.double() - refs[0]).norm() ** 2).item()
            x_ref2 += (refs[0].norm() ** 2).item()
            sums = list(refs[1:]) if sums is None else [s + r for s, r in zip(sums, refs[1:])]
    margins = {"grad_x": dict(misses=x_misses, numel=outputs[0].numel(),
                              relative_error=(x_error2 / x_ref2) ** 0.5,
                              ref_rms=(x_ref2 / outputs[0].numel()) ** 0.5)}
    for name, out, ref in zip(OUTPUT_NAMES[1:], outputs[1:], sums):
        margins[name] = dict(misses=_misses(out, ref), numel=ref.numel(),
                             relative_error=((out.double() - ref).norm() / ref.norm()).item(),
                             ref_rms=(ref.norm() / ref.numel() ** 0.5).item())
    for entry in margins.values():
        entry["matched"] = 1.0 - entry["misses"] / entry["numel"]
    return margins


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="32,56,420,1850",
                        help="comma-separated batch sizes, run in this order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", default="high", choices=("high", "highest"))
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    from vitattn_bwd.inductor import recorded_autotune_choices
    torch.backends.cuda.matmul.allow_tf32 = False     # the reference's own products
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        with recorded_autotune_choices() as choices:
            margins = contract_margins(batch, args.seed, args.precision)
        results.append(dict(batch=batch, margins=margins, autotune=choices))
        torch.cuda.empty_cache()
        print(f"\nbatch {batch} (K of the weight gradients = B*S = {batch * 577:,})")
        print(f"  {'output':16} {'matched':>9} {'misses':>7} {'rel error':>10} {'ref rms':>10}")
        for name, m in margins.items():
            print(f"  {name:16} {m['matched']:9.5f} {m['misses']:7d} "
                  f"{m['relative_error']:10.2e} {m['ref_rms']:10.3g}")
        for name, sizes, winner, timings in choices:
            best = min(timings.values(), default=float("nan"))
            print(f"  autotune {name} {sizes}: {winner} ({len(timings)} candidates, "
                  f"best {best:.3f} ms)")
    (args.out / "margin.json").write_text(json.dumps(results, indent=1))
    print("\nbatch  worst matched  (output)   vector misses (ln_weight, ln_bias, out_bias)")
    for result in results:
        name, worst = min(result["margins"].items(), key=lambda item: item[1]["matched"])
        vector = [result["margins"][v]["misses"] for v in VECTORS]
        print(f"{result['batch']:5d}  {worst['matched']:.5f}  ({name})  {vector}")


if __name__ == "__main__":
    main()
