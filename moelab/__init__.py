"""The ``moelab`` command line: joins the scheduler, traces, the simulator and the executor.

The one package above the others: ``scheduler`` <- ``traces`` <- ``simulate`` | ``execute`` <-
``moelab``. Nothing below imports it.
"""
