"""The TorchTrainer that pipeline/train/ray_train.py builds starts no DatasetManager actor: its workers read their own
rows, so Ray Train's DatasetsCallback would only start an idle process per run. A trainer given datasets keeps it."""
from __future__ import annotations


def _callbacks(**kwargs) -> list[str]:
    import ray.train
    from ray.train.torch import TorchTrainer

    from pipeline.train.distributed.failure_policy import trainer_class
    from pipeline.train.ray_train import _without_dataset_manager

    cls = _without_dataset_manager(trainer_class(TorchTrainer))
    assert _without_dataset_manager(trainer_class(TorchTrainer)) is cls  # one class per base, as trainer_class
    trainer = cls(lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=1), **kwargs)
    return [type(c).__name__ for c in trainer._create_default_callbacks()]


def test_without_datasets_no_dataset_manager_starts_and_every_other_callback_stays():
    names = _callbacks()
    assert "DatasetsCallback" not in names
    assert {"BackendSetupCallback", "PlacementGroupCleanerCallback", "UserCallbackHandler"} <= set(names)


def test_a_trainer_given_datasets_keeps_its_dataset_manager():
    assert "DatasetsCallback" in _callbacks(datasets={"train": lambda: None})
