"""The Gluon compile tests' covering subsets (``--sm90-cases cover``, what
.ci/newest-triton compiles under the newest Triton): each covers every (knob, value)
pair its whole list covers (every config field's value, head dim, mask, dtype, sinks,
user example), so a case added to a list is covered there too or this fails."""

import pytest
import test_gluon_bwd
import test_gluon_fwd
import test_gluon_user
from sm90 import covering


@pytest.mark.parametrize("cases, features", [
    (test_gluon_fwd.COMPILE_CASES, test_gluon_fwd.compile_features),
    (test_gluon_bwd.CASES, test_gluon_bwd.compile_features),
    (test_gluon_user.COMPILE_CASES, test_gluon_user.compile_features),
], ids=["forward", "backward", "user"])
def test_the_covering_cases_cover_every_knob_value_of_the_whole_list(cases, features):
    cover = covering(cases, features)
    assert set(map(repr, cover)) <= set(map(repr, cases))
    covered = set().union(*map(features, cover))
    missing = set().union(*map(features, cases)) - covered
    assert not missing, missing
