"""gridsim: a vectorised model of an AI campus power system, the test bed and sizing tool for dimmer."""
