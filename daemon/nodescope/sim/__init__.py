"""The simulated node: sysfs/procfs trees and fakes built from captures of real machines."""
