/* The size grammar shared by fakenvml's gpus file and gpu-alloc's --bytes. */
#ifndef FAKENVML_SIZE_H
#define FAKENVML_SIZE_H

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* Parse "24", "512M", "20G", "20GiB" (binary units) into bytes; 0 on success. */
static int parse_size(const char *s, unsigned long long *out)
{
    char *end;
    errno = 0;
    unsigned long long n = strtoull(s, &end, 10);
    if (end == s || errno || *s == '-')
        return -1;
    unsigned shift = 0;
    switch (toupper((unsigned char)*end)) {
    case 'K': shift = 10; break;
    case 'M': shift = 20; break;
    case 'G': shift = 30; break;
    case 'T': shift = 40; break;
    case '\0': return (*out = n), 0;
    case 'B': return end[1] ? -1 : ((*out = n), 0);
    default: return -1;
    }
    end++;
    if (*end && strcmp(end, "iB") != 0 && strcmp(end, "ib") != 0)
        return -1;
    if (n > (ULLONG_MAX >> shift))
        return -1;
    *out = n << shift;
    return 0;
}

#endif
