// SPDX-License-Identifier: GPL-2.0
/*
 * The mmio source: counter registers named by an operator-supplied map (PCI function, memory
 * BAR, offset, width). No NVIDIA register layout is public, so the module knows none: it maps
 * the ranges the map names and only ever reads them (readl/readq; nothing here writes to a
 * device). A register that reads all-ones is a device that fell off the bus (the PCI
 * convention for a master abort): its BAR is not read again and its links report
 * NVLC_LINK_DEVICE_GONE. Removal of the PCI device (hot-unplug, sysfs remove) is seen by a
 * bus notifier, which unmaps the range before the device goes away.
 */
#include <linux/io.h>
#include <linux/io-64-nonatomic-lo-hi.h>
#include <linux/notifier.h>
#include <linux/pci.h>
#include <linux/slab.h>

#include "nvlc.h"

DEFINE_MUTEX(nvlc_cfg_mutex);

/* Called from the timer with nvlc_lock held: read every register of @l into l->cum. */
bool nvlc_mmio_read_link(struct nvlc_link *l)
{
	unsigned int c;

	for (c = 0; c < NVLC_NUM_COUNTERS; c++) {
		struct nvlc_reg *r = l->regs[c];
		u64 raw;

		if (!r)
			continue;
		if (r->bar->gone)
			return false;
		if (r->width == 64) {
			raw = readq(r->addr);
			if (raw == U64_MAX)
				goto gone;
		} else {
			raw = readl(r->addr);
			if (raw == U32_MAX)
				goto gone;
		}
		if (!r->primed) {
			l->cum[c] = raw;
			r->primed = true;
		} else if (r->width == 64) {
			l->cum[c] += raw - r->prev_raw;
		} else {
			/* A 32-bit register wraps: its increase is taken modulo 2^32. */
			l->cum[c] += (u32)(raw - r->prev_raw);
		}
		r->prev_raw = raw;
	}
	return true;
gone:
	l->regs[c]->bar->gone = true;
	return false;
}

static int nvlc_find_link(const struct nvlc_state *s, u32 device, u32 link)
{
	u32 i;

	for (i = 0; i < s->nlinks; i++)
		if (s->links[i].device == device && s->links[i].link == link)
			return i;
	return -1;
}

static struct nvlc_bar *nvlc_find_bar(struct nvlc_state *s, const struct nvlc_mmio_reg *r)
{
	u32 i;

	for (i = 0; i < s->nbars; i++) {
		struct nvlc_bar *b = &s->bars[i];

		if ((u32)pci_domain_nr(b->pdev->bus) == r->domain && b->pdev->bus->number == r->bus &&
		    b->pdev->devfn == r->devfn && b->bar == r->bar)
			return b;
	}
	return NULL;
}

static int nvlc_check_reg(const struct nvlc_mmio_reg *r)
{
	if (memchr_inv(r->reserved, 0, sizeof(r->reserved)))
		return -EINVAL;
	if (r->bus > 255 || r->devfn > 255 || r->bar >= PCI_STD_NUM_BARS)
		return -EINVAL;
	if (r->width != 32 && r->width != 64)
		return -EINVAL;
	if (r->counter >= NVLC_NUM_COUNTERS)
		return -EINVAL;
	if (r->offset & (r->width / 8 - 1))
		return -EINVAL;
	if (r->offset > U64_MAX - 8)
		return -EINVAL;
	return 0;
}

/*
 * Fill @s (zeroed, links allocated for @nlinks) from the map. May sleep. On error the caller
 * frees @s with nvlc_state_free(), which releases whatever was mapped.
 */
int nvlc_mmio_build(const struct nvlc_mmio_link *links, u32 nlinks,
		    const struct nvlc_mmio_reg *regs, u32 nregs, struct nvlc_state *s)
{
	u32 i;
	int ret;

	s->source = NVLC_SOURCE_MMIO;
	for (i = 0; i < nlinks; i++) {
		const struct nvlc_mmio_link *ml = &links[i];

		if (memchr_inv(ml->reserved, 0, sizeof(ml->reserved)))
			return -EINVAL;
		if (ml->device >= NVLC_MAX_LINKS || ml->link >= NVLC_MAX_LINKS)
			return -EINVAL;
		if (!ml->capacity_bps || ml->capacity_bps > NVLC_MAX_CAPACITY_BPS)
			return -EINVAL;
		if (nvlc_find_link(s, ml->device, ml->link) >= 0)
			return -EINVAL;
		s->links[i].device = ml->device;
		s->links[i].link = ml->link;
		s->links[i].capacity = ml->capacity_bps;
		s->nlinks = i + 1;
	}

	s->regs = kvcalloc(nregs, sizeof(*s->regs), GFP_KERNEL);
	s->bars = kcalloc(NVLC_MAX_BARS, sizeof(*s->bars), GFP_KERNEL);
	if (!s->regs || !s->bars)
		return -ENOMEM;

	/* First pass: validate, and the extent of every BAR that the map names. */
	for (i = 0; i < nregs; i++) {
		const struct nvlc_mmio_reg *r = &regs[i];
		struct nvlc_bar *b;
		struct pci_dev *pdev;
		int li;
		u64 end;

		ret = nvlc_check_reg(r);
		if (ret)
			return ret;
		li = nvlc_find_link(s, r->device, r->link);
		if (li < 0 || s->links[li].regs[r->counter])
			return -EINVAL;
		/* Claimed for the duplicate check; pointed at the real register below. */
		s->links[li].regs[r->counter] = &s->regs[i];

		end = r->offset + r->width / 8;
		b = nvlc_find_bar(s, r);
		if (b) {
			b->start = min(b->start, r->offset);
			b->len = max(b->len, end);	/* end for now; a length after the pass */
			continue;
		}
		if (s->nbars == NVLC_MAX_BARS)
			return -E2BIG;
		pdev = pci_get_domain_bus_and_slot(r->domain, r->bus, r->devfn);
		if (!pdev)
			return -ENODEV;
		b = &s->bars[s->nbars++];
		b->pdev = pdev;
		b->bar = r->bar;
		b->start = r->offset;
		b->len = end;
	}

	/* Second pass over the BARs: the ranges must lie inside memory BARs; map them. */
	for (i = 0; i < s->nbars; i++) {
		struct nvlc_bar *b = &s->bars[i];
		u64 end = b->len;

		if (!(pci_resource_flags(b->pdev, b->bar) & IORESOURCE_MEM))
			return -EINVAL;
		if (end > pci_resource_len(b->pdev, b->bar))
			return -ERANGE;
		b->len = end - b->start;
		b->base = pci_iomap_range(b->pdev, b->bar, b->start, b->len);
		if (!b->base)
			return -ENOMEM;
	}

	for (i = 0; i < nregs; i++) {
		const struct nvlc_mmio_reg *r = &regs[i];
		struct nvlc_reg *reg = &s->regs[i];

		reg->bar = nvlc_find_bar(s, r);
		reg->addr = reg->bar->base + (r->offset - reg->bar->start);
		reg->width = r->width;
		reg->counter = r->counter;
	}
	s->nregs = nregs;
	return 0;
}

void nvlc_mmio_release(struct nvlc_state *s)
{
	u32 i;

	if (!s->bars)
		return;
	for (i = 0; i < s->nbars; i++) {
		struct nvlc_bar *b = &s->bars[i];

		if (b->base)
			pci_iounmap(b->pdev, b->base);
		b->base = NULL;
		pci_dev_put(b->pdev);
		b->pdev = NULL;
	}
}

static int nvlc_pci_notify(struct notifier_block *nb, unsigned long action, void *data)
{
	struct pci_dev *pdev = to_pci_dev(data);
	struct nvlc_state *s;
	unsigned long flags;
	bool hit = false;
	u32 i;

	if (action != BUS_NOTIFY_DEL_DEVICE)
		return NOTIFY_DONE;
	mutex_lock(&nvlc_cfg_mutex);
	s = nvlc_cur;	/* only swapped under nvlc_cfg_mutex */
	for (i = 0; s && s->bars && i < s->nbars; i++) {
		struct nvlc_bar *b = &s->bars[i];

		if (b->pdev != pdev || !b->base)
			continue;
		spin_lock_irqsave(&nvlc_lock, flags);
		b->gone = true;
		spin_unlock_irqrestore(&nvlc_lock, flags);
		/* The timer checks gone under nvlc_lock before every read: unmapping is safe. */
		pci_iounmap(pdev, b->base);
		b->base = NULL;
		hit = true;
	}
	mutex_unlock(&nvlc_cfg_mutex);
	if (hit)
		dev_info(&pdev->dev, "nvlink_counter: device removed, its counters are no longer read\n");
	return NOTIFY_OK;
}

static struct notifier_block nvlc_pci_nb = {
	.notifier_call = nvlc_pci_notify,
};

int nvlc_mmio_notifier_register(void)
{
	return bus_register_notifier(&pci_bus_type, &nvlc_pci_nb);
}

void nvlc_mmio_notifier_unregister(void)
{
	bus_unregister_notifier(&pci_bus_type, &nvlc_pci_nb);
}
