"""placeholder"""
def hook_targets():
    return []
