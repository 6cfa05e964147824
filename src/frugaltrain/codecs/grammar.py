"""The codec names `outer.codec` and `outer.param_codec` accept, and what each name says about
its codec, with no torch: the config checks a name before anything is built, and the control
plane (which imports the config) runs where torch is not installed.

    fp32, bf16, int8, e3m0      dense; also for parameters (PARAM_CODECS)
    2bit, 1bit                  dense with error feedback (FEEDBACK_CODECS)
    topk:F, topk:F+2bit         sparse, 0 < F <= 1 (`parse_codec`)

What each one does to a tensor is compress.py; what a codec with error feedback keeps is
feedback.py.
"""

from __future__ import annotations

PARAM_CODECS = ("fp32", "bf16", "int8", "e3m0")  # dense, for anything (compress.py)
CODECS = (*PARAM_CODECS, "2bit", "1bit")  # dense; the last two keep a residual, so not params
SPARSE_CODEC = "topk:FRACTION or topk:FRACTION+2bit, 0 < FRACTION <= 1"


def parse_codec(name: str) -> tuple[float, bool]:
    """(fraction, 2-bit values) of a sparse codec name `topk:F` or `topk:F+2bit`; ValueError
    for anything else."""
    body = name.removeprefix("topk:")
    two_bit = body.endswith("+2bit")
    try:
        fraction = float(body.removesuffix("+2bit"))
    except ValueError:
        fraction = -1.0
    if body == name or not 0 < fraction <= 1:
        raise ValueError(f"{name!r} is not {SPARSE_CODEC}")
    return fraction, two_bit


def codec_error(name: str, *, params: bool = False) -> str | None:
    """Why `name` is not a codec the config accepts (None: it is); `params`: for parameters,
    which a codec that keeps a residual (2bit, 1bit, top-k) cannot carry."""
    if name in (PARAM_CODECS if params else CODECS):
        return None
    if not params and name.startswith("topk:"):
        try:
            parse_codec(name)
            return None
        except ValueError:
            pass
    sparse = "" if params else f", or {SPARSE_CODEC}"
    return f"choose one of {', '.join(PARAM_CODECS if params else CODECS)}{sparse}"


FEEDBACK_CODECS = ("2bit", "1bit")
"""Dense codecs that keep what they did not send as error feedback."""


def is_sparse(codec: str) -> bool:
    return codec.startswith("topk:")


def keeps_residual(codec: str) -> bool:
    """Whether `codec` sends only part of a payload and keeps the rest as error feedback
    (feedback.py): the sparse codecs, 2bit and 1bit."""
    return is_sparse(codec) or codec in FEEDBACK_CODECS
