"""Named-dimension ops: communication derived from layouts (docs/names.md: dims vs mesh axes)."""
from functional_pp.ops import quantized as _quantized  # noqa: F401  (registers quantized weights with einsum)
from functional_pp.ops.attention import attention, positions
from functional_pp.ops.dropout import dropout
from functional_pp.ops.einsum import einsum
from functional_pp.ops.elementwise import (add, cos, div, exp, gelu, log, mul, relu, rsqrt, silu, sin, square, sub, tanh, where,
                                          xielu)
from functional_pp.ops.embedding import embed
from functional_pp.ops.indexing import concat, cumsum, slice_dim, take, unbind
from functional_pp.ops.scatter import masked_scatter
from functional_pp.ops.loss import IGNORE_INDEX, cross_entropy, token_log_probs
from functional_pp.ops.norms import layer_norm, rms_norm
from functional_pp.ops.realize import realized
from functional_pp.ops.reduce import logsumexp, max, mean, min, softmax, sum  # noqa: A004
from functional_pp.ops.rotary import (LinearScaling, Llama3Scaling, LongRopeScaling, ProportionalScaling, YarnScaling,
                                      inverse_frequencies, mrope_sections, rotary)
from functional_pp.ops.shape import merge_dims, rearrange, rename, split_dim, transpose
from functional_pp.ops.swiglu import swiglu
from functional_pp.ops.xent.linear import linear_cross_entropy

__all__ = ["attention", "positions", "einsum", "add", "sub", "mul", "div", "exp", "log", "gelu", "relu",
           "silu", "tanh", "rsqrt", "square", "where", "embed", "cross_entropy", "token_log_probs", "linear_cross_entropy", "IGNORE_INDEX",
           "rms_norm", "layer_norm", "logsumexp", "max", "mean", "min", "softmax", "sum", "rotary", "mrope_sections",
           "Llama3Scaling", "LongRopeScaling", "LinearScaling", "YarnScaling", "ProportionalScaling",
           "inverse_frequencies", "rename",
           "split_dim", "merge_dims", "rearrange",
           "transpose", "dropout", "concat", "cumsum", "slice_dim", "take", "unbind", "swiglu", "realized", "xielu",
           "cos", "sin", "masked_scatter"]
