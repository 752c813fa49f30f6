"""IPython magics that measure how far a model's output moves, each one call into the Python API as in
`exlnb.magics`: `%exl_quantize` makes a quantized model (docs/quantizing.md), `%exl_divergence` scores the loaded
model against a reference (docs/divergence.md), `%exl_noise_floor` measures how far the engine's own arithmetic
moves a margin (the near-tie map's floor, docs/tree.md). Each prints a table or a folder; a user's mistake is a
one-line `UsageError`.
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from exlnb.divergence import REFERENCE_DTYPES
from exlnb.engines.options import ENGINE_NAMES
from exlnb.magic_arguments import help_argument, out_argument, parse_options, sizes_argument, tidy_help, usage_errors
from exlnb.models import BUNDLED_MODEL
from exlnb.noise_floor import BATCH_SIZES, LAYOUT_NAMES, PROBE_TOKENS, PROBES, noise_floor
from exlnb.quantize import BITS_RANGE, DEFAULT_BITS, DEFAULT_FORMAT, DEFAULT_HEAD_BITS, QUANT_FORMATS, quantize
from exlnb.scoring import DEFAULT_TOKENS, divergence_from
from exlnb.session import get_session


@magics_class
class QualityMagics(Magics):
    @magic_arguments()
    @argument(
        "model",
        nargs="?",
        default=BUNDLED_MODEL,
        help=f'an unquantized model folder, a hub repo id, or "{BUNDLED_MODEL}" (default)',
    )
    @argument("--format", choices=QUANT_FORMATS, default=DEFAULT_FORMAT, help=f"the format (default {DEFAULT_FORMAT})")
    @argument(
        "--bits",
        type=float,
        default=DEFAULT_BITS,
        help=f"bits per weight (default {DEFAULT_BITS:g}; "
        + ", ".join(f"{fmt.upper()} {low:g}-{high:g}" for fmt, (low, high) in BITS_RANGE.items())
        + ")",
    )
    @argument("--head-bits", type=int, help=f"bits per weight of the output layer (default {DEFAULT_HEAD_BITS})")
    @help_argument
    @line_magic
    def exl_quantize(self, line: str) -> None:
        """Quantize with the library's own converter (cached, resumable) and print the folder to %exl_load."""
        if (args := parse_options(self.exl_quantize, line)) is None:
            return
        try:
            folder = quantize(args.model, format=args.format, bits=args.bits, head_bits=args.head_bits)
        except (ValueError, OSError, RuntimeError) as error:  # OSError: a file, or a folder it may not read
            raise UsageError(str(error)) from None
        print(folder)

    @magic_arguments()
    @argument(
        "reference",
        help='the reference: a model folder (or "smollm2-135m-instruct"), or a .pt file of '
        "reference logits that exlnb kept",
    )
    @argument(
        "--tokens",
        type=int,
        default=DEFAULT_TOKENS,
        help=f"length of the fixed text scored, for a reference folder (default {DEFAULT_TOKENS})",
    )
    @argument(
        "--engine",
        choices=ENGINE_NAMES,
        default="auto",
        help="the engine that computes the reference's logits when they are not cached (default: auto)",
    )
    @argument(
        "--dtype",
        choices=tuple(REFERENCE_DTYPES),
        default="float32",
        help="how the reference's logits are kept on disk (default: float32)",
    )
    @argument(
        "--no-noise-floor",
        action="store_true",
        help="leave out the noise floor (the reference scored again with bf16 rounding's noise)",
    )
    @out_argument("the Divergence")
    @help_argument
    @line_magic
    def exl_divergence(self, line: str) -> None:
        """Score the loaded model against a reference (KL per position, top-1 agreement, perplexities) and print
        the table; the reference's logits are computed once and cached on disk."""
        if (args := parse_options(self.exl_divergence, line)) is None:
            return
        with usage_errors():
            result = divergence_from(
                get_session(),
                args.reference,
                tokens=args.tokens,
                engine=args.engine,
                dtype=args.dtype,
                noise_floor=not args.no_noise_floor,
                progress=True,
            )
        print(result.table())
        if args.out:
            self.shell.user_ns[args.out] = result

    @magic_arguments()
    @argument("--probes", type=int, default=PROBES, help=f"questions answered greedily (default {PROBES})")
    @argument("--max-new-tokens", type=int, default=PROBE_TOKENS, help=f"tokens per answer (default {PROBE_TOKENS})")
    @argument(
        "--batch-sizes",
        type=sizes_argument,
        default=BATCH_SIZES,
        metavar="N,N",
        help=f"the batches each probe is run inside (default {','.join(map(str, BATCH_SIZES))})",
    )
    @argument("--no-layouts", action="store_true", help="leave out loading the model again another way")
    @out_argument("the NoiseFloor")
    @help_argument
    @line_magic
    def exl_noise_floor(self, line: str) -> None:
        """Measure how much this engine's arithmetic moves a margin (the near-tie map's noise floor) and print it."""
        if (args := parse_options(self.exl_noise_floor, line)) is None:
            return
        with usage_errors():
            floor = noise_floor(
                get_session(),
                probes=args.probes,
                max_new_tokens=args.max_new_tokens,
                batch_sizes=args.batch_sizes,
                layouts=() if args.no_layouts else LAYOUT_NAMES,
            )
        print(floor.table())
        if args.out:
            self.shell.user_ns[args.out] = floor


for _magic in (QualityMagics.exl_quantize, QualityMagics.exl_divergence, QualityMagics.exl_noise_floor):
    tidy_help(_magic)
