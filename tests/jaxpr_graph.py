"""Which equations of a traced step feed which: ordering checks without running."""

from jax.extend import core as jax_core


def find_body(jaxpr, primitive: str):
  """The innermost (closed or open) jaxpr nested in `jaxpr` whose own
  equations include `primitive`, or None."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  if any(e.primitive.name == primitive for e in jaxpr.eqns):
    return jaxpr
  for eqn in jaxpr.eqns:
    if "jaxpr" in eqn.params:
      found = find_body(eqn.params["jaxpr"], primitive)
      if found is not None:
        return found
  return None


def equations(jaxpr, primitive: str) -> list:
  """`jaxpr`'s own equations of `primitive`, in program order."""
  return [e for e in getattr(jaxpr, "jaxpr", jaxpr).eqns if e.primitive.name == primitive]


def depends_on(jaxpr, later, earlier) -> bool:
  """Whether equation `later` of `jaxpr` reads, at any distance, an output of `earlier`."""
  produced_by = {var: eqn for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns for var in eqn.outvars}
  stack, seen = list(later.invars), set()
  while stack:
    var = stack.pop()
    source = None if isinstance(var, jax_core.Literal) else produced_by.get(var)
    if source is None or id(source) in seen:
      continue
    if source is earlier:
      return True
    seen.add(id(source))
    stack.extend(source.invars)
  return False
