"""Giving memory back between the pieces of a step that streams."""


def release_memory():
    """Hand the memory of released objects back to the system: glibc keeps freed blocks
    in its heap otherwise, so the next chunk or model would sit on top of the last one's."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc: nothing to trim
        pass
