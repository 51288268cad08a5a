"""Training under MirroredStrategy on two logical CPU devices matches one device."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import json, features, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from features.synthetic import PRESETS
from retrieval.config import preset
from retrieval.train import evaluate_model, fit
log = features.generate(PRESETS["tiny"], seed=0)
parts = features.split(log)
results = {}
for strategy in ("default", "mirrored"):
    model, data, _ = fit(log, parts, preset("tiny", epochs=4, strategy=strategy), verbose=0)
    results[strategy] = evaluate_model(model, data, "test", ks=(10, 50))
    results[strategy + "_replicas"] = tf.distribute.MirroredStrategy().num_replicas_in_sync \\
        if strategy == "mirrored" else 1
print("RESULT", json.dumps(results))
"""


def test_mirrored_strategy_matches_one_device():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT"))
    results = json.loads(line[len("RESULT "):])
    assert results["mirrored_replicas"] == 2
    for metric in ("recall@10", "recall@50"):
        assert abs(results["default"][metric] - results["mirrored"][metric]) < 0.1, results
