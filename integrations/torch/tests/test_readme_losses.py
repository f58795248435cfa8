"""The README's PyTorch loss block (between <!-- torch-losses:begin --> and
<!-- torch-losses:end -->) runs as it is, and does what its comments say."""
import os
import re

import pytest
import torch

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "README.md")


def test_readme_loss_block_runs():
    if not os.path.exists(README):
        pytest.skip(f"no README at {README} (the tests run outside the repository)")
    text = open(README).read()
    found = re.search(r"<!-- torch-losses:begin -->\n```python\n(.*?)\n```\n<!-- torch-losses:end -->", text, re.S)
    assert found, "README: no ```python block between <!-- torch-losses:begin --> and <!-- torch-losses:end -->"
    torch.manual_seed(0)
    scope = {}
    exec(compile(found.group(1), "README.md (torch-losses)", "exec"), scope)
    assert scope["targets"].tolist()[3] == -100 and scope["targets"].tolist()[6] == -100
    assert int(scope["sft"].tokens) == 8 and int(scope["dpo"].pairs) == 2 and int(scope["pg"].tokens) == 8
    assert scope["h"].grad is not None and torch.isfinite(scope["h"].grad).all()
    assert scope["w"].grad is not None and torch.isfinite(scope["w"].grad).all()
    # Every token has its teacher's 8 ids: all 12 count; the top-8 of 1000 hold part of the mass.
    assert int(scope["kd"].tokens) == 12 and scope["student_logp"].shape == (12, 8)
    assert 0 < float(scope["kd"].teacher_mass) < 12 and float(scope["kd"].loss) > 0
    for result in ("sft", "dpo", "pg", "kd"):
        assert torch.isfinite(scope[result].loss), result
