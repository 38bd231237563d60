"""moelab's real executor: GGUF models, CuPy GPU expert kernels, a Numba CPU expert pool.

Importing ``execute`` loads neither cupy nor numba; the modules that need them import them.
"""
