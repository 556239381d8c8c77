"""ridethrough.actuators"""
