"""Communication units: which parameters travel together, found from the model's own structure.

A unit is the granularity of every collective: one gather before its forward, one reduce after its
backward. Users never wrap anything; `plan_units` finds the units:

1. the repeated blocks: modules whose class is named in Hugging Face `_no_split_modules`, or else the
   children of a ModuleList/Sequential whose children all share one class (transformer layers);
2. outside those blocks, any module holding at least `size_threshold` parameters of its own subtree
   (embeddings, a big head) becomes a unit;
3. everything left - and every parameter shared by modules of two different units (tied embedding and
   head) - belongs to the root unit, which is gathered for the whole forward and backward.

[Note: unit order]
Units are listed in module registration order with the root first. That order is only the initial
guess of execution order; the stage-3 prefetcher records the real order on every forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass
class UnitSpec:
    """One unit's module and the parameters it owns (each parameter is owned by exactly one unit)."""

    name: str
    """Module path of the unit ("" for the root)."""
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]
    """(qualified name of the first occurrence, parameter), in module order."""

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


def _no_split_class_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for m in model.modules():
        found = getattr(m, "_no_split_modules", None)
        if found:
            names.update(found)
    return names


def _repeated_children(module: nn.Module) -> list[nn.Module] | None:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return None
    children = list(module.children())
    if len(children) >= 2 and len({type(c) for c in children}) == 1 and any(
            True for c in children for _ in c.parameters()):
        return children
    return None


def _find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost repeated blocks, in registration order."""
    by_class = _no_split_class_names(model)
    blocks: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if by_class and type(child).__name__ in by_class:
                blocks.append((path, child))
                continue
            if not by_class:
                repeated = _repeated_children(child)
                if repeated is not None:
                    for sub_name, sub in child.named_children():
                        blocks.append((f"{path}.{sub_name}", sub))
                    continue
            visit(f"{path}.", child)

    visit("", model)
    return blocks


def _carve_large(model: nn.Module, block_ids: set[int], threshold: int) -> list[tuple[str, nn.Module]]:
    """Smallest modules outside the blocks whose not-yet-claimed parameters reach `threshold`.

    Bottom-up: a child that reaches the threshold claims its parameters first, so a parent is carved
    only for what its children left. Modules that contain a block are never carved (units don't nest).
    """
    carved: list[tuple[str, nn.Module]] = []

    def visit(path: str, module: nn.Module) -> tuple[int, bool]:
        """(unclaimed parameter count of the subtree, whether it contains a block)."""
        if id(module) in block_ids:
            return 0, True
        left, has_block = sum(p.numel() for p in module.parameters(recurse=False)), False
        for name, child in module.named_children():
            n, b = visit(f"{path}.{name}" if path else name, child)
            left, has_block = left + n, has_block or b
        if module is not model and not has_block and left >= threshold:
            carved.append((path, module))
            return 0, False
        return left, has_block

    visit("", model)
    return carved


def plan_units(model: nn.Module, *, size_threshold: int = 10_000_000) -> list[UnitSpec]:
    """Split `model`'s parameters into communication units (root unit first, then in module order)."""
    blocks = _find_blocks(model)
    block_ids = {id(m) for _, m in blocks}
    registration = {id(m): i for i, m in enumerate(model.modules())}
    unit_modules = sorted(blocks + _carve_large(model, block_ids, size_threshold),
                          key=lambda item: registration[id(item[1])])
    unit_of_module: dict[int, int] = {}

    def assign(module: nn.Module, unit: int) -> None:
        unit_of_module[id(module)] = unit
        for child in module.children():
            assign(child, unit_index.get(id(child), unit))

    unit_index = {id(m): i + 1 for i, (_, m) in enumerate(unit_modules)}
    assign(model, 0)

    owners: dict[int, set[int]] = {}
    first: dict[int, tuple[str, nn.Parameter]] = {}
    order: list[int] = []
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            key = id(p)
            if key not in first:
                first[key] = (f"{mod_name}.{p_name}" if mod_name else p_name, p)
                order.append(key)
            owners.setdefault(key, set()).add(unit_of_module[id(module)])

    specs = [UnitSpec(name="", module=model, params=[])]
    specs += [UnitSpec(name=name, module=m, params=[]) for name, m in unit_modules]
    for key in order:
        units = owners[key]
        specs[units.pop() if len(units) == 1 else 0].params.append(first[key])
    return [specs[0]] + [s for s in specs[1:] if s.params]
