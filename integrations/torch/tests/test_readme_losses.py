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
    for result in ("sft", "dpo", "pg"):
        assert torch.isfinite(scope[result].loss), result
