"""Sensor drivers for the gateway: GPIO (pulse counters, digital inputs), 1-Wire, serial,
I2C. Each driver module declares its sensor type (``registry.py``).

Drivers know nothing of MQTT or SQLite: they push ``SensorReading``,
``SensorFault`` and ``ClockFix`` objects into a ``Sink`` (see ``api.py``).
"""
