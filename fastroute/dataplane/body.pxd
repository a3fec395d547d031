# Augmenting declarations for the compiled build of body.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
cdef class RequestMeta:
    cdef public object _obj, body, fields, stream, batch, input_tokens, return_logprob, max_new_tokens, model, path

    cpdef shed(self)
