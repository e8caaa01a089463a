# A whole MicroPython image for an ESP32, written to the next OTA partition.
#
# esp32.Partition (MicroPython's docs/library/esp32.rst): the running partition's
# get_next_update() is the one to write; blocks are 4096 bytes; a block is erased
# (ioctl 6) before its first chunk and written with the extended writeblocks(block,
# buf, offset), which does not erase, so chunks that divide 4096 never straddle two
# blocks. After the last chunk the image is read back and its SHA-256 checked before
# set_boot(). Boards without OTA partitions (a Pico W, an ESP32 flashed with a
# partition table that has none) have no esp32 module, or no next partition: the
# node then refuses image offers and takes only application files.
import hashlib

try:
    from binascii import hexlify
except ImportError:
    from ubinascii import hexlify

BLOCK = 4096
ERASE = 6  # MP_BLOCKDEV_IOCTL_BLOCK_ERASE
READ = 512


class ImageSink:
    def __init__(self):
        from esp32 import Partition  # ImportError on a board without it

        self.part = Partition(Partition.RUNNING).get_next_update()
        info = self.part.info()
        self.size = info[3]
        self.label = info[4]

    def write(self, offset, data):
        block, at = divmod(offset, BLOCK)
        if at == 0:
            self.part.ioctl(ERASE, block)
        self.part.writeblocks(block, data, at)

    def sha(self, size):
        h = hashlib.sha256()
        buf = bytearray(READ)
        done = 0
        while done < size:
            n = min(READ, size - done)
            view = memoryview(buf)[:n]
            block, at = divmod(done, BLOCK)
            self.part.readblocks(block, view, at)
            h.update(view)
            done += n
        return hexlify(h.digest()).decode()

    def switch(self):
        self.part.set_boot()


def sink():
    """The next OTA partition, or None where there is none."""
    try:
        return ImageSink()
    except (ImportError, OSError, AttributeError):
        return None
