"""The experiments (one module or package each, registered in `report.EXPERIMENTS`).

Importing the package registers the experiments' cache-spec options (`@alloc=`, `@heavy=`:
`cache_plans`), so every experiment and every command taking `--caches` accepts them."""
from fibquant.eval import cache_plans  # noqa: F401  (registers @alloc= and @heavy= with fibquant.kv.specs)
