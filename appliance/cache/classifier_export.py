"""Compiles the shipped decision rule's classifier to ONNX (part of `appliance semantic-setup`).

Needs the `onnx` package (the set-up extra); the gateway only loads the result (classifier.py). The
graph is paraphrase.Rule.numpy_scores written out: the network over the two vectors and the pair
features, then the boosted trees over the features and the network's probability, then the logistic.
The trees take float64 inputs and thresholds (the trees were fitted in float64 and the numpy
evaluation compares in float64), so a feature equal to a float32-rounded threshold goes the same way
in both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from appliance.cache.classifier import FILE, STAMP
from appliance.cache.paraphrase import RULE_FILE, Rule


def export_classifier(dest: Path, rule_file: Path = RULE_FILE) -> Path:
    """Writes dest/classifier.onnx for the rule in `rule_file`; returns its path."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rule = Rule(rule_file)
    with np.load(rule_file) as data:
        trees = _tree_attributes(data)
    weights = {
        "proj": rule.proj,
        "mean": rule.mean,
        "scale": rule.scale,
        "w1": rule.w1,
        "b1": rule.b1,
        "w2": rule.w2.reshape(-1, 1),
        "b2": np.array([rule.b2], dtype=np.float32),
    }
    node = helper.make_node
    nodes = [
        node("MatMul", ["u", "proj"], ["pu"]),
        node("MatMul", ["v", "proj"], ["pv"]),
        node("Mul", ["pu", "pv"], ["product"]),
        node("Sub", ["pu", "pv"], ["difference"]),
        node("Abs", ["difference"], ["distance"]),
        node("Sub", ["x", "mean"], ["centred"]),
        node("Div", ["centred", "scale"], ["standard"]),
        node("Concat", ["product", "distance", "standard"], ["z"], axis=1),
        node("MatMul", ["z", "w1"], ["h_in"]),
        node("Add", ["h_in", "b1"], ["h_biased"]),
        node("Relu", ["h_biased"], ["h"]),
        node("MatMul", ["h", "w2"], ["logit_in"]),
        node("Add", ["logit_in", "b2"], ["logit"]),
        node("Sigmoid", ["logit"], ["network"]),
        node("Concat", ["x", "network"], ["stacked"], axis=1),
        node("Cast", ["stacked"], ["stacked64"], to=TensorProto.DOUBLE),
        node(
            "TreeEnsembleRegressor",
            ["stacked64"],
            ["raw"],
            domain="ai.onnx.ml",
            n_targets=1,
            aggregate_function="SUM",
            post_transform="NONE",
            **trees,
        ),
        node("Sigmoid", ["raw"], ["score"]),
    ]
    features = int(rule.mean.shape[0])
    dim = int(rule.proj.shape[0])
    graph = helper.make_graph(
        nodes,
        "semantic_rule_classifier",
        [
            helper.make_tensor_value_info("u", TensorProto.FLOAT, ["m", dim]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, ["n", dim]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", features]),
        ],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, ["n", 1])],
        [numpy_helper.from_array(a.astype(np.float32), name) for name, a in weights.items()],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 3)],
    )
    model.ir_version = 8
    helper.set_model_props(model, {STAMP: rule.digest})
    onnx.checker.check_model(model)
    path = dest / FILE
    partial = path.with_suffix(".partial")
    partial.write_bytes(model.SerializeToString())
    partial.replace(path)
    return path


def _tree_attributes(data: Any) -> dict[str, Any]:
    """The ensemble's reachable nodes as TreeEnsembleRegressor attributes: a node goes to its
    left (true) child when the feature is <= its threshold, as in paraphrase.Trees."""
    from onnx import numpy_helper

    leaf = data["tree_leaf"].astype(bool)
    out: dict[str, list[Any]] = {
        key: []
        for key in [
            "nodes_treeids",
            "nodes_nodeids",
            "nodes_featureids",
            "nodes_modes",
            "nodes_truenodeids",
            "nodes_falsenodeids",
            "target_treeids",
            "target_nodeids",
            "target_ids",
        ]
    }
    thresholds: list[float] = []
    values: list[float] = []
    for tree in range(leaf.shape[0]):
        reachable, todo = [], [0]
        while todo:
            n = todo.pop()
            reachable.append(n)
            if not leaf[tree, n]:
                todo += [int(data["tree_left"][tree, n]), int(data["tree_right"][tree, n])]
        for n in sorted(reachable):
            out["nodes_treeids"].append(tree)
            out["nodes_nodeids"].append(n)
            if leaf[tree, n]:
                out["nodes_featureids"].append(0)
                out["nodes_modes"].append("LEAF")
                out["nodes_truenodeids"].append(0)
                out["nodes_falsenodeids"].append(0)
                thresholds.append(0.0)
                out["target_treeids"].append(tree)
                out["target_nodeids"].append(n)
                out["target_ids"].append(0)
                values.append(float(data["tree_value"][tree, n]))
            else:
                out["nodes_featureids"].append(int(data["tree_feature"][tree, n]))
                out["nodes_modes"].append("BRANCH_LEQ")
                out["nodes_truenodeids"].append(int(data["tree_left"][tree, n]))
                out["nodes_falsenodeids"].append(int(data["tree_right"][tree, n]))
                thresholds.append(float(data["tree_threshold"][tree, n]))
    as_tensor = numpy_helper.from_array
    return {
        **out,
        "nodes_values_as_tensor": as_tensor(np.array(thresholds, dtype=np.float64)),
        "target_weights_as_tensor": as_tensor(np.array(values, dtype=np.float64)),
        "base_values_as_tensor": as_tensor(np.array([float(data["tree_base"])], np.float64)),
    }
