"""Tensor dims are *dims*, mesh axes are *axes* (docs/names.md): declarations and checkpoint
specs name their dims ``dims``; the old ``axes`` spellings still work and warn."""
import pytest

import functional_pp as fpp
from functional_pp import checkpoint as ck


def test_param_and_spec_name_their_dims():
    p = fpp.param((4, 8), "hidden mlp")
    assert p.dims == ("hidden", "mlp")
    assert fpp.param((4, 8), dims=("hidden", "mlp")) == p
    assert ck.Spec((4, 8), "hidden mlp").dims == ("hidden", "mlp")


def test_old_axes_spellings_warn_and_still_work():
    with pytest.warns(DeprecationWarning, match="param\\(dims=...\\)"):
        p = fpp.param((4, 8), axes="hidden mlp")
    assert p.dims == ("hidden", "mlp")
    with pytest.warns(DeprecationWarning, match="Param.dims"):
        assert p.axes == ("hidden", "mlp")
    with pytest.warns(DeprecationWarning, match="Spec.dims"):
        assert ck.Spec((4,), "hidden").axes == ("hidden",)


def test_dims_given_twice_or_not_at_all_is_refused():
    with pytest.raises(TypeError, match="once, as dims="):
        fpp.param((4,), "hidden", axes="hidden")
    with pytest.raises(TypeError, match="missing the dimension names"):
        fpp.param((4,))
    with pytest.raises(ValueError, match="one name per dimension"):
        fpp.param((4, 8), "hidden")
