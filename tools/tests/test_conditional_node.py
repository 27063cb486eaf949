"""tools/conditional_node.py imports on a CPU machine (its set kernel's link without a GPU:
tests/test_fallback_gate.py)."""
from tools import conditional_node


def test_the_experiment_imports_and_has_its_graph_kinds():
    assert callable(conditional_node.capture) and callable(conditional_node.main)
