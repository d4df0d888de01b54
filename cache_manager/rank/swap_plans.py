"""The swap plans of a rank's cache kinds, merged where they can be, built once per set of plans.

A swap task copies the same blocks for every cache kind (K, V, scales).  Kinds whose blocks have
the same size and strides on both sides share one merged plan, so a task costs one kernel call
per block shape instead of one per kind, and a layer-wise task one per layer and shape.

The merged plans are rebuilt whenever the kinds' plans are other objects than last time (an RL
restore re-attaches the caches at new addresses).  The check is by identity against the plans
held here: never by ``id()`` of plans that may have been freed, since a new plan often reuses the
address of the old one, and the old merged plan would then copy into memory the engine let go.
"""
from __future__ import annotations

import operator
from typing import Sequence

from ops.layout import CopyPlan, layer_range, merge_plans


def _same_shape(plans: Sequence[CopyPlan]) -> list[list[CopyPlan]]:
    shapes: dict[tuple, list[CopyPlan]] = {}
    for plan in plans:
        shapes.setdefault((plan.block_bytes, plan.device.stride, plan.host.stride), []).append(plan)
    return list(shapes.values())


class SwapPlans:
    """Per set of kind plans: ``whole`` (merged plans for a whole-task copy) and ``per_layer``
    (for each layer, the merged plans of that layer).  Safe to call from several task threads:
    each result is published as one tuple together with the plans it was built from."""

    def __init__(self) -> None:
        self._whole: tuple[tuple[CopyPlan, ...], list[CopyPlan]] = ((), [])
        self._layers: tuple[tuple[CopyPlan, ...], list[list[CopyPlan]]] = ((), [])

    @staticmethod
    def _built_from(built: tuple, plans: Sequence[CopyPlan]) -> bool:
        source = built[0]
        return len(source) == len(plans) and all(map(operator.is_, source, plans))

    def whole(self, plans: Sequence[CopyPlan]) -> list[CopyPlan]:
        built = self._whole
        if not self._built_from(built, plans):
            built = self._whole = (tuple(plans), [merge_plans(same) for same in _same_shape(plans)])
        return built[1]

    def per_layer(self, plans: Sequence[CopyPlan], plan_layers: Sequence[Sequence[int]] | None = None
                  ) -> list[list[CopyPlan]]:
        """For each model layer, the merged plans of the kinds that have it.  ``plan_layers[i]`` are
        the model layers of ``plans[i]``'s tensors (a cache group may have only some layers);
        by default every plan has every layer."""
        built = self._layers
        if not self._built_from(built, plans):
            if plan_layers is None:
                plan_layers = [range(len(p.device.bases)) for p in plans]
            where = [{layer: i for i, layer in enumerate(layers)} for layers in plan_layers]
            total = max((max(layers) + 1 for layers in plan_layers if len(layers)), default=0)
            per_layer = []
            for layer in range(total):
                here = [layer_range(p, w[layer], w[layer] + 1) for p, w in zip(plans, where) if layer in w]
                per_layer.append([merge_plans(same) for same in _same_shape(here)])
            built = self._layers = (tuple(plans), per_layer)
        return built[1]
