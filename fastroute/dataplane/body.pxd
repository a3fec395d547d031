# Augmenting declarations for the compiled build of body.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
cimport cython

from fastroute.dataplane._jsonscan cimport Chat
from fastroute.dataplane._splice cimport object_bounds, with_int
from fastroute.dataplane.fields cimport FieldPicker

cdef class RequestMeta:
    cdef public object _obj, body, fields, batch, input_tokens, return_logprob, max_new_tokens, path, labels, token_ids
    cdef readonly object model
    cdef readonly object stream

    cpdef shed(self)

# The parse of every inference request: C calls inside this module, typed dicts (a dict call,
# not a method lookup, per key read). Still importable from Python.
cpdef estimate_tokens(text)
cpdef _opt_int(dict obj, key, where=*)
cpdef _parse_generate(dict obj, RequestMeta meta)
cpdef _openai_common(dict obj, RequestMeta meta)
cpdef _parse_completions(dict obj, RequestMeta meta)
@cython.locals(chat=Chat)
cpdef _parse_chat(dict obj, RequestMeta meta)
@cython.locals(picker=FieldPicker, obj=dict, meta=RequestMeta)
cpdef RequestMeta parse_request(path, body)

# A PD attempt's fields (pd.py calls these in C).
@cython.locals(_try=int)
cpdef draw_room(rng, prefill_dp_size=*, prefill_rank=*)
cpdef bytes bootstrap_fields(batch, tuple values, rng, prefill_dp_size, prefill_rank)
cpdef tuple splice_point(body)
cpdef tuple _object_bounds(body)
