"""A small placement prediction for tests of the trainer's metrics (no placement run needed)."""

from __future__ import annotations

from moment.contracts.placed import Prediction


def prediction(bin_shares: dict[str, float]) -> Prediction:
    """The paper layout on moment-machine-b, fan-outs 10,5, batch 512, with these bin shares."""
    return Prediction.model_validate(
        {
            "source": "dataset",
            "profile": "moment-machine-b",
            "layout": "paper",
            "iteration_s": 0.5,
            "tier_shares": {"gpu": 0.2, "cpu": 0.1, "ssd": 0.7},
            "bin_shares": bin_shares,
            "workload": {
                "fanouts": [10, 5],
                "batch_size": 512,
                "unique_per_batch": 100.0,
                "gpu_cache_rows": 10,
                "cpu_cache_rows": 10,
                "hotness": "measured",
            },
        }
    )
