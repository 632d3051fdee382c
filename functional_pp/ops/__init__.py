"""Named-dimension ops: communication derived from layouts (docs/names.md: dims vs mesh axes)."""
from .attention import attention, positions
from .einsum import einsum
from .elementwise import add, div, exp, gelu, log, mul, relu, rsqrt, silu, square, sub, tanh, where
from .dropout import dropout
from .embedding import embed
from .indexing import concat, cumsum, slice_dim, take, unbind
from .loss import IGNORE_INDEX, cross_entropy
from .linear_xent import linear_cross_entropy
from .norms import layer_norm, rms_norm
from .realize import realized
from .reduce import logsumexp, max, mean, softmax, sum  # noqa: A004
from .rotary import Llama3Scaling, inverse_frequencies, rotary
from .shape import merge_dims, rearrange, rename, split_dim, transpose
from .swiglu import swiglu

__all__ = ["attention", "positions", "einsum", "add", "sub", "mul", "div", "exp", "log", "gelu", "relu",
           "silu", "tanh", "rsqrt", "square", "where", "embed", "cross_entropy", "linear_cross_entropy", "IGNORE_INDEX",
           "rms_norm", "layer_norm", "logsumexp", "max", "mean", "softmax", "sum", "rotary",
           "Llama3Scaling", "inverse_frequencies", "rename", "split_dim", "merge_dims", "rearrange",
           "transpose", "dropout", "concat", "cumsum", "slice_dim", "take", "unbind", "swiglu", "realized"]
