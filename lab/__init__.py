"""ridethrough.lab"""
